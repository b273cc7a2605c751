"""The runtime package stays in small pieces: no module over 800 lines, no function over 60.

The limits keep each module to one job and each function readable in one screen. Declarative
tables (the alert and recording rules, the argparse parser builders) are long because they
list things, not because they do many things; they are exempt by name below, each with its
reason. An exemption that no longer applies (the module or function is gone, or now fits the
limit) fails too, so the list cannot rot.

Lengths are measured as ``wc -l`` for modules and ``end_lineno - lineno + 1`` for functions
(methods and nested functions included, named by their dotted path in the module).
"""

from __future__ import annotations

import ast
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "exporter" / "kvtax"

K = TypeVar("K")

MAX_MODULE_LINES = 800
MAX_FUNCTION_LINES = 60

# Module path (relative to exporter/kvtax) -> why it may be longer.
# None today: the metric catalog and the options table were split to fit (catalog_gate and
# spec beside the catalog, option beside the options).
MODULE_EXEMPTIONS: dict[str, str] = {}

# (module path, function) -> why it may be longer.
FUNCTION_EXEMPTIONS: dict[tuple[str, str], str] = {
    ("mixin/rules/alerts.py", "alert_rules"): "declarative table of the alert rules, in file order",
    ("mixin/rules/recording.py", "recording_rules"): (
        "declarative table of the recording rules, in evaluation order"
    ),
    ("cli/plan.py", "add_parser"): "declarative table of the kvtax plan flags (argparse)",
    ("cli/loadtest.py", "add_parser"): ("declarative table of the kvtax loadtest flags (argparse)"),
    ("cli/annotate.py", "add_parser"): ("declarative table of the kvtax annotate flags (argparse)"),
}


def _modules() -> Iterator[tuple[str, str]]:
    """(path relative to the package, source text) of every module of the package."""
    for path in sorted(PACKAGE.rglob("*.py")):
        yield path.relative_to(PACKAGE).as_posix(), path.read_text()


def _functions(tree: ast.AST, prefix: str = "") -> Iterator[tuple[str, int]]:
    """(dotted name, length in lines) of every function in ``tree``, nested ones included."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            name = f"{prefix}{node.name}"
            if not isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                yield name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{name}.")
        else:
            yield from _functions(node, prefix)


def module_lengths() -> dict[str, int]:
    """Module path -> lines, as ``wc -l`` counts them."""
    return {path: text.count("\n") for path, text in _modules()}


def function_lengths() -> dict[tuple[str, str], int]:
    """(module path, dotted function name) -> lines of the function, decorators excluded."""
    out: dict[tuple[str, str], int] = {}
    for path, text in _modules():
        for name, length in _functions(ast.parse(text, filename=path)):
            out[(path, name)] = length
    return out


def over_limit(lengths: Mapping[K, int], limit: int, exempt: Mapping[K, str]) -> dict[K, int]:
    """The entries of ``lengths`` above ``limit`` that ``exempt`` does not name."""
    return {k: n for k, n in lengths.items() if n > limit and k not in exempt}


def stale(lengths: Mapping[K, int], limit: int, exempt: Mapping[K, str]) -> list[str]:
    """Why each exemption in ``exempt`` is no longer needed: gone, or within the limit."""
    out: list[str] = []
    for key in exempt:
        if key not in lengths:
            out.append(f"{key}: no longer exists")
        elif lengths[key] <= limit:
            out.append(f"{key}: {lengths[key]} lines, within the limit of {limit}")
    return out


def test_no_module_over_the_limit() -> None:
    over = over_limit(module_lengths(), MAX_MODULE_LINES, MODULE_EXEMPTIONS)
    assert not over, (
        f"modules over {MAX_MODULE_LINES} lines (split them along a seam): "
        + ", ".join(f"exporter/kvtax/{path} ({n})" for path, n in sorted(over.items()))
    )


def test_no_function_over_the_limit() -> None:
    over = over_limit(function_lengths(), MAX_FUNCTION_LINES, FUNCTION_EXEMPTIONS)
    assert not over, (
        f"functions over {MAX_FUNCTION_LINES} lines (break them into helpers): "
        + ", ".join(
            f"exporter/kvtax/{path} {name} ({n})" for (path, name), n in sorted(over.items())
        )
    )


def test_every_exemption_is_still_needed() -> None:
    problems = stale(module_lengths(), MAX_MODULE_LINES, MODULE_EXEMPTIONS)
    problems += stale(function_lengths(), MAX_FUNCTION_LINES, FUNCTION_EXEMPTIONS)
    assert not problems, "remove these exemptions: " + "; ".join(problems)


def test_every_exemption_is_a_declarative_table() -> None:
    reasons = [*MODULE_EXEMPTIONS.values(), *FUNCTION_EXEMPTIONS.values()]
    assert all(reason.startswith("declarative table of ") for reason in reasons)


def test_the_measure_counts_methods_and_nested_functions() -> None:
    tree = ast.parse(
        "class A:\n    def m(self):\n        def inner():\n            pass\n        return 1\n"
        "async def f():\n    pass\n"
    )
    assert dict(_functions(tree)) == {"A.m": 4, "A.m.inner": 2, "f": 2}
    assert over_limit({"a": 3, "b": 5, "c": 9}, 4, {"c": "declarative table of c"}) == {"b": 5}
    assert stale({"a": 3, "c": 9}, 4, {"a": "x", "c": "y", "gone": "z"}) == [
        "a: 3 lines, within the limit of 4",
        "gone: no longer exists",
    ]
