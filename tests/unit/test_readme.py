"""The README's overhead figures are the ones bench/results holds: a rerun that changes a results
file, or a README edit that changes a figure, fails here until the two agree again.

Each row of the README's "Overhead" table names its source: the results page it links, or, for
the proxy's rows, ``bench/results/relay.md``, where each figure must sit in the kvtax or nginx
row of the same number of streams in its first table (the latest run); the rows without a link
come from ``bench/README.md``. Every number of a row's result must appear in its source.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
RELAY = ROOT / "bench" / "results" / "relay.md"
BENCH = ROOT / "bench" / "README.md"

# A number not glued to a word (p99's 99 is a name, not a figure), signed or not, with thousands
# separators; "7-14" is a range of two numbers, not 7 and -14.
_NUMBER = re.compile(r"(?<![\w.])[-+]?\d[\d,]*(?:\.\d+)?")


def numbers(text: str) -> set[str]:
    """The numbers of ``text`` as written, thousands separators dropped."""
    text = re.sub(r"(?<=\d)-(?=\d)", " ", text)
    return {n.replace(",", "").rstrip(".") for n in _NUMBER.findall(text)}


def overhead_rows() -> list[tuple[str, str]]:
    """(what, result) of each row of the README's Overhead table."""
    section = README.read_text().split("## Overhead", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ")]
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows[1:]]
    return [(what, result) for what, result in cells if not set(what) <= {"-"}]


def relay_rows(streams: str) -> str:
    """The kvtax and nginx rows of relay.md's first table at ``streams`` concurrent streams."""
    table = RELAY.read_text().split("| streams | relay |", 1)[1].splitlines()
    rows = []
    for line in table[2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == streams and cells[1] in {"kvtax", "nginx"}:
            rows.append(line)
    assert len(rows) == 2, f"relay.md has no kvtax and nginx rows at {streams} streams"
    return "\n".join(rows)


def source_of(what: str, result: str) -> tuple[str, str]:
    """(name, text) of where a row's figures come from."""
    linked = re.findall(r"\]\((bench/results/[\w.-]+\.md)\)", result)
    if linked:
        return linked[0], (ROOT / linked[0]).read_text()
    if what.startswith("proxy"):
        streams = re.search(r"\b(\d+) (?:paced |short )?streams", what)
        assert streams, what
        return f"relay.md at {streams.group(1)} streams", relay_rows(streams.group(1))
    return "bench/README.md", BENCH.read_text()


def test_numbers_are_figures_not_names_or_ranges() -> None:
    got = numbers("p99 gap -1.04 ms at 7-14 ms, 10,000 requests, 2.50x")
    assert got == {"-1.04", "7", "14", "10000", "2.50"}


def test_the_overhead_table_has_the_proxy_rows_relay_md_measures() -> None:
    rows = dict(overhead_rows())
    assert len(rows) >= 7
    proxy = [what for what in rows if what.startswith("proxy") and "soak" not in what]
    assert len(proxy) == 4, proxy


def missing_figures(what: str, result: str) -> tuple[str, list[str]]:
    """(source name, the row's figures its source does not hold)."""
    name, source = source_of(what, result)
    # The figures only: a linked page's name is not one.
    figures = numbers(re.sub(r"\([^)]*\.md\)", "", result))
    assert figures, result
    return name, sorted(figures - numbers(source))


@pytest.mark.parametrize(("what", "result"), overhead_rows(), ids=lambda v: v[:40])
def test_every_overhead_figure_is_in_its_results_file(what: str, result: str) -> None:
    name, missing = missing_figures(what, result)
    assert missing == [], f"README's {what!r}: {missing} not in {name}"


def test_a_stale_figure_is_caught() -> None:
    # The aiohttp relay's cost, which the README still quoted after relay.md had moved on.
    stale = (
        "added TTFB p50 +29 to +48 ms (nginx about 0); added p99 gap -1.4 to +4.6 ms; "
        "CPU per chunk 3.6x to 4.1x nginx's"
    )
    _, missing = missing_figures("proxy, 64 paced streams, beside nginx", stale)
    assert {"3.6", "4.1", "+29", "+48"} <= set(missing)
    _, missing = missing_figures("proxy RSS at 512 streams", "90 MB")
    assert missing == ["90"]
