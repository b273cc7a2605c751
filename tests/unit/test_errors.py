"""kvtax's one exception tree (kvtax.errors): its drawing matches the classes, bad input of every
subcommand is an InputError, and ``kvtax`` prints it once, as one line naming the field."""

from __future__ import annotations

import ast
import importlib
import inspect
import os
import pkgutil
import re
from pathlib import Path

import pytest

import kvtax
from kvtax import errors
from kvtax.cli.main import main
from kvtax.delivery.adapters import AdapterError
from kvtax.delivery.intake import PushError
from kvtax.engine.normalize import ParseError
from kvtax.errors import (
    ConfigError,
    InputError,
    KvtaxError,
    PlanError,
    RequestError,
    RulesConfigError,
    UpstreamError,
)
from kvtax.serve.sources.bodies import BodyTooLarge
from kvtax.serve.sources.push import GatewayError, Redirected
from kvtax.tools.loadtest.plots import PlotsUnavailable

# A node of the drawing: the root at the block's indent, every other class after "├── " or
# "└── ", behind one "│   " or "    " per level above it. Continuation lines have no connector.
_NODE = re.compile(r"^    (?:(?P<above>(?:[│ ]   )*)[├└]── )?(?P<name>[A-Z]\w*)(?:\s|$)")


@pytest.fixture(autouse=True)
def _no_kvtax_env(monkeypatch: pytest.MonkeyPatch) -> None:
    # Settings from the developer's shell must not change what `kvtax serve` is given.
    for name in list(os.environ):
        if name.startswith("KVTAX_"):
            monkeypatch.delenv(name)


def _drawing() -> dict[str, str | None]:
    """The tree of kvtax.errors' docstring: each class drawn, by name, with its drawn parent."""
    doc = errors.__doc__ or ""
    block = doc.split("::\n", 1)[1].split("\n\n", 1)[0]
    parents: dict[str, str | None] = {}
    path: list[str] = []  # the names on the way down to the line being read
    for line in block.splitlines():
        match = _NODE.match(line)
        if match is None:
            continue
        above = match["above"]
        depth = 0 if above is None else len(above) // 4 + 1
        assert depth <= len(path), f"{line!r} is drawn below nothing"
        del path[depth:]
        parents[match["name"]] = path[-1] if path else None
        path.append(match["name"])
    return parents


def _kvtax_subclasses() -> set[type[BaseException]]:
    """Every subclass of KvtaxError that kvtax defines, after importing every module of it."""
    for module in pkgutil.walk_packages(kvtax.__path__, "kvtax."):
        importlib.import_module(module.name)
    found: set[type[BaseException]] = set()
    todo: list[type[BaseException]] = [KvtaxError]
    while todo:
        cls = todo.pop()
        if cls.__module__.split(".")[0] == "kvtax" and cls not in found:
            found.add(cls)
            todo.extend(cls.__subclasses__())
    return found


def test_the_drawing_names_exactly_the_classes_of_the_tree() -> None:
    drawn = _drawing()
    classes = {cls.__name__: cls for cls in _kvtax_subclasses()}
    assert len(classes) == len(_kvtax_subclasses()), "two classes of the tree share a name"
    assert sorted(drawn) == sorted(classes)
    assert drawn["KvtaxError"] is None
    for name, parent in drawn.items():
        if parent is not None:
            bases = [base.__name__ for base in classes[name].__bases__]
            assert parent in bases, f"{name} is drawn under {parent}; its bases are {bases}"


def test_the_tree_module_imports_nothing_from_kvtax() -> None:
    tree = ast.parse(Path(inspect.getfile(errors)).read_text(encoding="utf-8"))
    imported = [
        name
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for name in (
            [alias.name for alias in node.names]
            if isinstance(node, ast.Import)
            else [node.module or ""]
        )
    ]
    assert [name for name in imported if name.split(".")[0] == "kvtax"] == []


@pytest.mark.parametrize("cls", [InputError, ConfigError, RulesConfigError, PlanError])
def test_bad_input_is_an_input_error_a_kvtax_error_and_a_value_error(cls: type) -> None:
    assert issubclass(cls, InputError)
    assert issubclass(cls, KvtaxError)
    # Kept, so `except ValueError` and pytest.raises(ValueError) go on catching bad input.
    assert issubclass(cls, ValueError)


def test_the_other_branches() -> None:
    cls: type[Exception]
    for cls in (PushError, BodyTooLarge):
        assert issubclass(cls, RequestError)
    for cls in (ParseError, AdapterError, GatewayError, Redirected):
        assert issubclass(cls, UpstreamError)
    # Each stays what it was before the tree, for the catches that name the builtin.
    for cls in (PushError, BodyTooLarge, ParseError, AdapterError, GatewayError):
        assert issubclass(cls, ValueError)
    assert issubclass(PlotsUnavailable, KvtaxError)
    assert issubclass(PlotsUnavailable, RuntimeError)
    for cls in (RequestError, UpstreamError, PlotsUnavailable):
        assert not issubclass(cls, InputError), cls


def test_input_error_is_one_line_naming_the_field() -> None:
    err = PlanError("--kv-cache-dtype", "unknown dtype 'fp7'\n  (known: fp8)")
    assert str(err) == "--kv-cache-dtype: unknown dtype 'fp7' (known: fp8)"
    assert (err.field, err.message) == ("--kv-cache-dtype", "unknown dtype 'fp7' (known: fp8)")
    whole = ConfigError("--scrape.interval='-1s' is invalid:\nmust be greater than 0")
    assert str(whole) == "--scrape.interval='-1s' is invalid: must be greater than 0"
    assert whole.field is None


def test_bad_plan_input_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["plan", "--layers", "32", "--kv-heads", "8", "--head-dim", "128"]
    assert main([*argv, "--kv-cache-dtype", "fp7"]) == 2
    out = capsys.readouterr()
    assert out.out == ""
    assert out.err.startswith("kvtax plan: --kv-cache-dtype: unknown dtype 'fp7'")
    assert out.err.count("\n") == 1


def test_a_bad_rules_config_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    bad = tmp_path / "rules.yaml"
    bad.write_text("tax_warning: lots\n")
    for argv, command in [
        (["rules", "--config", str(bad), "--out", str(tmp_path / "alerts")], "kvtax rules"),
        (
            ["dashboards", "generate", "--config", str(bad), "--out", str(tmp_path / "d")],
            "kvtax dashboards generate",
        ),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"{command}: {bad}: tax_warning: "), err
        assert err.count("\n") == 1
    assert not (tmp_path / "alerts").exists()
    assert not (tmp_path / "d").exists()


def test_a_bad_loadtest_flag_exits_2_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    # The levels are checked before anything is sent: the URL is never reached.
    assert main(["loadtest", "http://127.0.0.1:9", "--levels", "8,4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtax loadtest: --levels: '8,4': ")
    assert err.count("\n") == 1


def test_a_bad_serve_setting_exits_2_with_one_line_before_any_server(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["serve", "--scrape.interval=-1s"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvtax serve: --scrape.interval='-1s' is invalid: ")
    assert err.count("\n") == 1
