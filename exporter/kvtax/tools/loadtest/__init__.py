"""``kvtax loadtest`` and ``kvtax annotate``: the engine's side of a load test.

Pure modules (no I/O): :mod:`.errors`, :mod:`.distributions`, :mod:`.plan`, :mod:`.measure`,
:mod:`.knees`, :mod:`.report`, :mod:`.guidellm`, :mod:`.timeline`, :mod:`.annotate`. The I/O
edges: :mod:`.driver` (the sweep, over HTTP), :mod:`.sources` (a recording file or a
Prometheus), :mod:`.plots` (PNG files, with matplotlib when installed), :mod:`.output`
(the report files) and the command lines :mod:`.cli` and :mod:`.annotate_cli`.
"""
