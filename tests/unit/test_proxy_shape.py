"""The proxy's shape: one owner per accounted request, one decision of its outcome, no circles.

An accounted request's facts are written by its owner (:mod:`kvtax.serve.proxy.request`)
alone, and its outcome is decided once however it ends; the proxy's modules import each other
one way only; and adding a generation API is a dialect the proxy, the gate and the join read
from one list.
"""

from __future__ import annotations

import ast
import asyncio
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from kvtax.delivery import dialects
from kvtax.delivery.dialects import DIALECTS, HANDLERS, dialect_for
from kvtax.figures.window import SERVED_HANDLERS
from kvtax.serve.proxy import request as request_module
from kvtax.serve.proxy.outcome import Facts, Phase, outcome_of
from tests.unit.sourcescan import docstring_ids
from tests.unit.test_proxy_http import CHAT, STREAM, WHOLE, Start, post, read_reply

pytest_plugins = ["tests.unit.test_proxy_http"]

ROOT = Path(__file__).resolve().parents[2]
SERVE = ROOT / "exporter" / "kvtax" / "serve"


def _imports(path: Path) -> set[str]:
    """What of kvtax ``path`` imports, TYPE_CHECKING imports included: the modules, and the
    dotted names taken from them (``from package import submodule`` is the submodule's)."""
    out: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kvtax"):
            for alias in node.names:
                name = f"{node.module}.{alias.name}"
                out.add(name)
                if not _is_module(name):
                    out.add(node.module)
        elif isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names if alias.name.startswith("kvtax"))
    return out


def _is_module(name: str) -> bool:
    base = ROOT / "exporter" / Path(*name.split("."))
    return base.with_suffix(".py").is_file() or (base / "__init__.py").is_file()


def _strings(path: Path) -> set[str]:
    """The string constants of ``path``'s code, docstrings (and their examples) left out."""
    tree = ast.parse(path.read_text())
    docstrings = docstring_ids(tree)
    return {
        node.value
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant)
        and isinstance(node.value, str)
        and id(node) not in docstrings
    }


def _module(path: Path) -> str:
    parts = path.relative_to(ROOT / "exporter").with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def test_only_the_request_s_owner_holds_its_facts() -> None:
    holders = {
        _module(path)
        for path in SERVE.rglob("*.py")
        if "kvtax.serve.proxy.outcome.Facts" in _imports(path)
    }
    assert holders == {"kvtax.serve.proxy.request"}


def test_no_import_circle_in_serve() -> None:
    modules = {_module(path): path for path in SERVE.rglob("*.py")}
    edges = {
        name: {m for m in _imports(path) if m in modules and m != name}
        for name, path in modules.items()
    }
    seen: dict[str, int] = {}  # 1: on the path being walked, 2: done

    def walk(name: str, path: list[str]) -> list[str] | None:
        seen[name] = 1
        for nxt in sorted(edges[name]):
            if seen.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt] if nxt in path else [*path, nxt]
            if nxt not in seen and (found := walk(nxt, [*path, nxt])) is not None:
                return found
        seen[name] = 2
        return None

    for name in sorted(modules):
        if name not in seen:
            circle = walk(name, [name])
            assert circle is None, " -> ".join(circle)


def test_every_generation_api_is_one_dialect_read_from_one_list() -> None:
    routes = [route for dialect in DIALECTS for route in dialect.routes]
    assert len(routes) == len(set(routes)), "two dialects claim one route"
    assert HANDLERS == SERVED_HANDLERS
    assert tuple(routes) == HANDLERS[: len(routes)]
    assert set(HANDLERS[len(routes) :]) == set(dialects.UNCOUNTED)
    assert len({d.name for d in DIALECTS}) == len(DIALECTS) == len(dialects.APIS)
    assert all(dialect_for(route) is d for d in DIALECTS for route in d.routes)
    # No module of what runs in the pod spells a generation API's path in its code but its
    # dialect's (the offline tools are clients: they choose an API to call).
    pod = ("serve", "delivery", "figures", "gate", "expose", "engine")
    spelled = {
        _module(path)
        for part in pod
        for path in (ROOT / "exporter" / "kvtax" / part).rglob("*.py")
        if _strings(path) & set(HANDLERS)
    }
    # (the routes vLLM generates on that no dialect counts are listed beside the dialects).
    assert spelled == {d.__module__ for d in DIALECTS} | {"kvtax.delivery.dialects"}, spelled
    assert dialects.dialect_for("/v1/models") is None


async def test_the_outcome_is_decided_once_per_request(
    start: Start, monkeypatch: pytest.MonkeyPatch
) -> None:
    decided: list[str] = []
    real: Callable[[Facts, Phase], str] = outcome_of

    def counting(facts: Facts, phase: Phase) -> str:
        outcome = real(facts, phase)
        decided.append(outcome)
        return outcome

    monkeypatch.setattr(request_module, "outcome_of", counting)
    rig = await start()
    bodies: list[tuple[str, dict[str, Any]]] = [
        ("/v1/completions", WHOLE),
        ("/v1/completions", STREAM),
        ("/v1/chat/completions", {**CHAT, "stream": True}),
    ]
    for path, body in bodies:
        reply = await rig.exchange(post(path, body))
        assert reply.status == 200
    # A client that leaves mid-stream settles once too.
    rig.vllm.delay = 0.05
    reader, writer = await rig.connect()
    writer.write(post("/v1/completions", STREAM))
    await reader.readuntil(b"data:")
    writer.close()
    for _ in range(200):
        if len(decided) == len(bodies) + 1 and rig.proxy.in_flight == 0:
            break
        await asyncio.sleep(0.01)
    assert decided == ["completed"] * len(bodies) + ["client_disconnected"]
    # A request that passes through has no outcome to decide.
    reader, writer = await rig.connect()
    writer.write(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
    assert (await read_reply(reader)).status == 200
    assert len(decided) == len(bodies) + 1
