"""vLLM's preemption counter read straight from a committed recording, for the annotate tests.

Independent of kvtax's readers on purpose: a regular expression over each recorded page, so a
test that compares kvtax's annotated preemptions with it checks kvtax against the raw text.
"""

from __future__ import annotations

import gzip
import json
import re
from pathlib import Path

_PREEMPTIONS = re.compile(r"^vllm:num_preemptions_total\{[^}]*\} (\S+)$", re.MULTILINE)


def preemption_series(recording: Path) -> list[tuple[float, float]]:
    """(time, vllm:num_preemptions_total summed over its series) for each recorded page."""
    series = []
    with gzip.open(recording, "rt") as f:
        for line in f:
            row = json.loads(line)
            values = [float(v) for v in _PREEMPTIONS.findall(row["page"])]
            series.append((float(row["t"]), sum(values)))
    return sorted(series)


def increase(series: list[tuple[float, float]], start: float, end: float) -> float:
    """The counter's rise from the last page at or before ``start`` to the first at or after
    ``end``."""
    before = [v for t, v in series if t <= start]
    after = [v for t, v in series if t >= end]
    return after[0] - before[-1]
