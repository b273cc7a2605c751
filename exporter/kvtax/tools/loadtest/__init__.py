"""``kvtax loadtest`` and ``kvtax annotate``: the engine's side of a load test.

Pure modules (no I/O): :mod:`.distributions`, :mod:`.plan`, :mod:`.measure`, :mod:`.knees`,
:mod:`.table` (the report's rows), :mod:`.finite`, the benchmark tools' readers
(:mod:`.tools`: :mod:`.guidellm`, :mod:`.aiperf`, :mod:`.vllmbench`), :mod:`.timeline` and
:mod:`.annotate`. The I/O edges: :mod:`.driver` (the sweep, over HTTP), :mod:`.sources` (a
recording file or a Prometheus), :mod:`.plots` (PNG files, with matplotlib when installed) and
:mod:`.output` (the report files). The command lines are :mod:`kvtax.cli.loadtest` and
:mod:`kvtax.cli.annotate`; bad input raises :class:`kvtax.errors.InputError`.
"""
