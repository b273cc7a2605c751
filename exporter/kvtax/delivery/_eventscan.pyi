# The C twin of kvtax.delivery.eventscan.scan_ids_py (see that module).
def scan_ids(
    data: bytes, keep_ids: bool, include_usage: bool, /
) -> tuple[bytes, int, int, int, int] | None: ...
