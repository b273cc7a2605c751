# The C twins of kvtax.delivery.eventscan.scan_ids_py and scan_usage_py (see that module).
def scan_ids(
    data: bytes, keep_ids: bool, include_usage: bool, /
) -> tuple[bytes, int, int, int, int] | None: ...
def scan_usage(
    data: bytes, keep: bool, include_usage: bool, /
) -> tuple[bytes, int, int, int, int] | None: ...
