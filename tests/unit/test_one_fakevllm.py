"""One fake vLLM (issue 46): no module outside ``exporter/kvtax_dev/fakevllm/`` writes vLLM's
event streams of its own, so a rule of vLLM's stream is written once, in its builder.

A stream ends with ``data: [DONE]``: a module that writes that event is writing whole streams.
So the check is on the source: a ``[DONE]`` event a module *writes* — bytes with ``[DONE]`` in
them, text with ``data:`` and ``[DONE]``, or the payload ``"[DONE]"`` handed to a helper that
frames it — anywhere in tests/, bench/, scripts/ and the rest of kvtax_dev, is a stand-in of its
own. Reading one is fine: a ``[DONE]`` in an ``assert``, a
comparison (``==``, ``in``) or a reader's argument (``startswith``, ``count``...) is what a
client or a test looks for, and docstrings and comments say what a stream is. A test or a
script that needs a ``[DONE]`` of its own takes it from the builder
(:func:`kvtax_dev.fakevllm.events.done`). kvtax's own package (exporter/kvtax) is not held to
it: it relays vLLM's ``[DONE]`` and matches on it, and writes none (``test_kvtax_writes_no_done``).

The check cannot pass by finding nothing: it finds the builder's own ``[DONE]``, and the reads
it lets through are counted.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

from kvtax_dev.fakevllm.events import DONE, done
from tests.unit.sourcescan import docstring_ids

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "exporter" / "kvtax_dev" / "fakevllm"
KVTAX = ROOT / "exporter" / "kvtax"
# The methods whose argument is a pattern looked for, not an event written.
READERS = {
    "startswith",
    "endswith",
    "count",
    "find",
    "rfind",
    "index",
    "split",
    "partition",
    "removeprefix",
    "removesuffix",
}


def _is_done(value: object) -> bool:
    """A constant that spells a [DONE] event, or its payload alone (what a helper that adds
    ``data:`` is handed)."""
    if isinstance(value, bytes):
        return b"[DONE]" in value
    return isinstance(value, str) and ("data:" in value or value == "[DONE]") and "[DONE]" in value


def _read_here(tree: ast.Module) -> set[int]:
    """ids of the constants in a reading position: under an assert, a comparison or a reader's
    call (its arguments)."""
    found: set[int] = set()
    for node in ast.walk(tree):
        reading: list[ast.AST] = []
        if isinstance(node, ast.Assert | ast.Compare):
            reading = [node]
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Attribute)
            and node.func.attr in READERS
        ):
            reading = list(node.args)
        found |= {id(inner) for part in reading for inner in ast.walk(part)}
    return found


def done_events(path: Path) -> tuple[list[int], int]:
    """The lines where ``path`` writes a [DONE] event, and how many it only reads."""
    text = path.read_text()
    if "DONE" not in text:
        return [], 0  # no constant of it can spell [DONE]: the parse is the check's cost
    tree = ast.parse(text, filename=str(path))
    skip, read = docstring_ids(tree), _read_here(tree)
    written, reads = [], 0
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and _is_done(node.value) and id(node) not in skip:
            if id(node) in read:
                reads += 1
            else:
                written.append(node.lineno)
    return sorted(written), reads


def _outside() -> Iterator[Path]:
    """Every Python module of the checkout but kvtax's package, the fake itself and this test
    (whose example of a stand-in, below, writes [DONE] on purpose)."""
    for top in ("tests", "bench", "scripts", "exporter/kvtax_dev"):
        for path in sorted((ROOT / top).rglob("*.py")):
            if PACKAGE not in path.parents and path != Path(__file__).resolve():
                yield path


def test_no_module_outside_the_fake_writes_a_done_event() -> None:
    modules = list(_outside())
    writers = {}
    reads = 0
    for path in modules:
        written, read = done_events(path)
        reads += read
        if written:
            writers[str(path.relative_to(ROOT))] = written
    assert not writers, f"[DONE] events written outside kvtax_dev/fakevllm (take done()): {writers}"
    # Not vacuous: it read every test, bench and script, and let through the reads among them
    # (clients that stop at [DONE], assertions on a relayed stream's end).
    assert len(modules) > 200
    assert ROOT / "tests" / "unit" / "test_proxy_http.py" in modules
    assert reads >= 10


def test_the_check_finds_the_builders_done() -> None:
    # The builder writes the one [DONE]: the check, run on it, sees it.
    written, _ = done_events(PACKAGE / "events.py")
    assert written
    assert DONE == b"data: [DONE]\n\n"
    assert done(lead=b"data:", end=b"") == b"data:[DONE]"


def test_the_check_tells_a_write_from_a_read(tmp_path: Path) -> None:
    module = tmp_path / "stand_in.py"
    module.write_text(
        '"""A stream ends with data: [DONE]."""\n'
        "async def answer(response, line):\n"
        '    assert line != b"data: [DONE]"\n'
        '    if line.startswith(b"data: [DONE]") or line == "data: [DONE]":\n'
        "        return\n"
        '    await response.write(b"data: [DONE]\\n\\n")\n'
        '    await response.write("data:[DONE]\\n\\n".encode())\n'
        '    await response.write(b"[DONE]")\n'
    )
    assert done_events(module) == ([6, 7, 8], 3)


def test_kvtax_writes_no_done() -> None:
    # Why kvtax's package is left out: it relays vLLM's [DONE] and makes none up. The one
    # constant the check would count there is the pair of spellings delivery/sse.py matches a
    # line against (with the space and without).
    holders = {
        str(path.relative_to(KVTAX)): written
        for path in sorted(KVTAX.rglob("*.py"))
        if (written := done_events(path)[0])
    }
    assert list(holders) == ["delivery/sse.py"]
    assert len(holders["delivery/sse.py"]) == 2
