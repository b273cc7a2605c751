"""bench/ is benches grouped by family over a small library: they read processes through one
module (bench/procfs.py), take quantiles through one function (bench/stats.py, kvtax loadtest's
own) and write tables and result files through one module (bench/record.py), so two benches
cannot report the same figure two ways nor write it in two shapes; no module is over 800 lines;
and every ``python -m bench...`` command the docs give names a module that exists."""

from __future__ import annotations

import ast
import importlib.util
import re
from pathlib import Path

import pytest
from bench import procfs, record, stats

from kvtax.tools.loadtest.measure import quantile as loadtest_quantile
from tests.unit.sourcescan import docstring_ids

BENCH = Path(__file__).resolve().parents[2] / "bench"
LIBRARY = {"procfs.py", "stats.py", "net.py", "record.py"}
FAMILIES = {"relay", "soak", "gate", "scrape", "engine", "tools"}
REPO = BENCH.parent
QUANTILE = re.compile(r"^_?(quantile|percentile|pct|p\d\d)$|quantile$", re.IGNORECASE)
# A Markdown table's rule: "|---|", "|---:|", ":---:|" or "---|" repeated.
TABLE_RULE = re.compile(r"\|:?-{3,}|-{3,}:?\|")
# (module, function) -> why the JSON file it writes is not a result.
NOT_RESULTS = {
    ("tools/guidellm_run.py", "tokenizer_copy"): "guidellm's tokenizer config, an input to it",
}


def _modules() -> list[Path]:
    """Every bench module but the library's (by path: bench/gate/stats.py is a bench's)."""
    return sorted(p for p in BENCH.rglob("*.py") if p.parent != BENCH or p.name not in LIBRARY)


@pytest.mark.parametrize("path", _modules(), ids=lambda p: p.name)
def test_a_bench_reads_processes_and_quantiles_through_the_library(path: Path) -> None:
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = docstring_ids(tree)
    for node in ast.walk(tree):
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            assert not QUANTILE.search(node.name) or node.name == "censored_quantile", (
                f"{path.name}:{node.lineno}: {node.name}() - use bench.stats.quantile"
            )
        if isinstance(node, ast.Import | ast.ImportFrom):
            names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
            assert "psutil" not in names, f"{path.name}:{node.lineno}: psutil - use bench.procfs"
        code = isinstance(node, ast.Constant) and id(node) not in docstrings
        if code and isinstance(node, ast.Constant) and isinstance(node.value, str):
            assert not node.value.startswith("/proc"), (
                f"{path.name}:{node.lineno}: reads /proc - use bench.procfs"
            )
        if isinstance(node, ast.JoinedStr):  # f"/proc/{pid}/..."
            heads = [v.value for v in node.values if isinstance(v, ast.Constant)]
            assert not any("/proc" in str(h) for h in heads), (
                f"{path.name}:{node.lineno}: reads /proc - use bench.procfs"
            )


def _hand_rolled(source: str) -> list[tuple[int, str, str]]:
    """(line, enclosing function, what) of each Markdown table rule and each JSON dumped into a
    file in ``source``: ``json.dump`` to anything but stdout or stderr, and ``write_text`` or
    ``write_bytes`` of a ``json.dumps``. Printing a JSON line as a run goes is not a file."""
    tree = ast.parse(source)
    docstrings = docstring_ids(tree)
    found: list[tuple[int, str, str]] = []

    def visit(node: ast.AST, function: str) -> None:
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            function = node.name
        if isinstance(node, ast.Constant) and _a_rule(node, docstrings):
            found.append((node.lineno, function, "a table rule"))
        if isinstance(node, ast.Call) and (what := _json_into_a_file(node)):
            found.append((node.lineno, function, what))
        for child in ast.iter_child_nodes(node):
            visit(child, function)

    visit(tree, "")
    return found


def _a_rule(node: ast.Constant, docstrings: set[int]) -> bool:
    """Whether ``node`` is a string of code (not a docstring) holding a Markdown table rule."""
    text = node.value
    return isinstance(text, str) and id(node) not in docstrings and bool(TABLE_RULE.search(text))


def _json_into_a_file(call: ast.Call) -> str:
    """What ``call`` writes as JSON into a file, or "" when it does not."""
    name = ast.unparse(call.func)
    if name == "json.dump":
        into = [*call.args[1:2], *(k.value for k in call.keywords if k.arg == "fp")]
        return "" if [ast.unparse(i) for i in into] in (["sys.stdout"], ["sys.stderr"]) else name
    method = name.rpartition(".")[2]
    dumps = any(
        isinstance(n, ast.Call) and ast.unparse(n.func) == "json.dumps"
        for arg in call.args
        for n in ast.walk(arg)
    )
    return f"{method}(json.dumps(...))" if method in {"write_text", "write_bytes"} and dumps else ""


@pytest.mark.parametrize(
    "path",
    _modules(),
    ids=lambda p: p.relative_to(BENCH).as_posix(),
)
def test_a_bench_writes_tables_and_result_files_through_record(path: Path) -> None:
    where = path.relative_to(BENCH).as_posix()
    found = [
        f"{where}:{line}: {what} - use bench.record"
        for line, function, what in _hand_rolled(path.read_text())
        if (where, function) not in NOT_RESULTS
    ]
    assert not found, "\n".join(found)


def test_the_scan_tells_a_result_file_from_a_progress_line() -> None:
    source = """
import json, sys
def table(): return "| a | b |\\n|---|---:|"
def rule(n): return "|" + "---|" * n
def dumped(f, x): json.dump(x, f)
def written(path, x): path.write_text(json.dumps(x, indent=2) + "\\n")
def progress(x):
    '''A docstring may show a table: | a |, |---|.'''
    print(json.dumps(x), flush=True)
    json.dump(x, sys.stderr)
    json.dump(x, fp=sys.stdout)
    return "a - b -- c"
"""
    assert [(f, what) for _, f, what in _hand_rolled(source)] == [
        ("table", "a table rule"),
        ("rule", "a table rule"),
        ("dumped", "json.dump"),
        ("written", "write_text(json.dumps(...))"),
    ]


def test_each_exception_still_applies() -> None:
    """Each JSON file that is not a result is still written where NOT_RESULTS says: an
    exception that no longer applies fails."""
    for (module, function), why in NOT_RESULTS.items():
        found = {f for _, f, _ in _hand_rolled((BENCH / module).read_text())}
        assert function in found, f"{module}: {function}() no longer writes {why}"


def test_the_benches_quantile_is_the_loadtests() -> None:
    values = [5.0, 1.0, 4.0, 2.0, 3.0]
    for q in (0.0, 0.5, 0.9, 0.99, 1.0):
        assert stats.quantile(values, q) == loadtest_quantile(values, q)
    assert stats.quantile([], 0.5) != stats.quantile([], 0.5)  # NaN for none


def test_procfs_reads_this_process() -> None:
    import os

    me = [os.getpid()]
    assert procfs.rss_bytes(me) > 0
    assert procfs.peak_rss_bytes(me) >= procfs.rss_bytes(me)
    assert procfs.run_seconds(me) > 0
    assert procfs.cpu_seconds(me) >= 0
    assert procfs.open_fds(os.getpid()) > 0
    assert "python" in procfs.name(os.getpid()).lower() or procfs.cmdline(os.getpid())
    assert procfs.rss_bytes([2**22 + 7]) == 0  # a process that is not there counts nothing


def test_a_table_marks_each_columns_alignment() -> None:
    text = record.table(["name", "n", "ok"], [["a", "1", "yes"], ["b", "22", "no"]], "lrc")
    assert text.splitlines() == [
        "| name | n | ok |",
        "|---|---:|:---:|",
        "| a | 1 | yes |",
        "| b | 22 | no |",
    ]
    # Every column left unless told, and no newline at the end: the caller joins the lines.
    assert record.table(["a", "b"], []) == "| a | b |\n|---|---|"


def test_a_table_refuses_a_row_or_an_alignment_of_another_width() -> None:
    with pytest.raises(ValueError, match="row 2 has 1 cells for 2 columns"):
        record.table(["a", "b"], [["1", "2"], ["3"]])
    with pytest.raises(ValueError, match="align 'r'"):
        record.table(["a", "b"], [], "r")
    with pytest.raises(ValueError, match="align 'lx'"):
        record.table(["a", "b"], [], "lx")


def test_a_record_is_the_markdown_and_the_figures_with_sorted_keys(tmp_path: Path) -> None:
    name = tmp_path / "new" / "folder" / "run.md"  # the flag names the Markdown
    figures = {"b": [1, 2.5], "a": {"z": None, "y": "x"}}
    written = record.save(name, "# run\n\n| a |\n|---|\n\n\n", figures)
    md, js = tmp_path / "new" / "folder" / "run.md", tmp_path / "new" / "folder" / "run.json"
    assert written == [md, js]
    assert md.read_text() == "# run\n\n| a |\n|---|\n"  # one newline at the end
    assert js.read_text() == (
        '{\n  "a": {\n    "y": "x",\n    "z": null\n  },\n  "b": [\n    1,\n    2.5\n  ]\n}\n'
    )
    assert record.save(tmp_path / "new" / "folder" / "run.json", "again", {}) == [md, js]
    assert (md.read_text(), js.read_text()) == ("again\n", "{}\n")


def test_a_record_leaves_alone_the_half_it_is_not_given(tmp_path: Path) -> None:
    (tmp_path / "x.md").write_text("written by hand\n")
    assert record.save(tmp_path / "x.json", None, {"n": 1}) == [tmp_path / "x.json"]
    assert (tmp_path / "x.md").read_text() == "written by hand\n"
    assert record.save(tmp_path / "y", "text", None) == [tmp_path / "y.md"]
    assert not (tmp_path / "y.json").exists()


def test_bench_is_families_over_a_small_library() -> None:
    top = {p.name for p in BENCH.glob("*.py")}
    assert top == LIBRARY | {"__init__.py"}, top - LIBRARY
    assert {p.name for p in BENCH.iterdir() if p.is_dir() and p.name != "__pycache__"} == (
        FAMILIES | {"results"}
    )
    long = {p.name: n for p in BENCH.rglob("*.py") if (n := len(p.read_text().splitlines())) > 800}
    assert not long, f"bench modules over 800 lines: {long}"


def test_every_bench_command_in_the_docs_names_a_module() -> None:
    docs = [REPO / "README.md", *REPO.glob("docs/*.md"), *REPO.glob("bench/**/*.md")]
    docs += [*BENCH.rglob("*.py"), *REPO.glob("tests/fixtures/*/README.md")]
    named = {m for doc in docs for m in re.findall(r"-m (bench(?:\.[a-z_]+)+)", doc.read_text())}
    assert "bench.relay" in named
    assert "bench.gate.fair" in named
    missing = sorted(m for m in named if not _exists(m))
    assert not missing, f"commands name modules that do not exist: {missing}"


def _exists(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:  # a parent package that does not exist
        return False
