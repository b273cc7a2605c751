#!/usr/bin/env python3
"""Capture real vLLM /metrics expositions as test fixtures, using the kvtax testbed.

Starts one testbed engine (16 KV blocks = 2,048 tokens, --max-num-seqs 64), then writes:

- ``<version>-idle.prom``: GET /metrics right after startup, engine idle;
- ``<version>-preempting.prom``: GET /metrics taken *during* an overload (64 concurrent
  streamed requests of 41 prompt + 500 output tokens, ignore_eos), chosen among the
  polled snapshots as one with requests running and waiting, preemptions already
  counted, and the highest KV usage;
- ``<version>-after-overload.prom``: GET /metrics once the load has finished and the
  engine is idle again.

- ``apis/<version>-<api>.sse`` and ``.json``: the bodies of the generation APIs beyond
  completions and chat (Anthropic's Messages, OpenAI's Responses, generate, batch chat),
  streamed and not, 12 tokens each, as vLLM writes them (the engine runs with
  ``--enable-scale-out`` for generate); and completions and chat streamed as kvtax asks for
  them by the ``token_ids`` scheme (``return_token_ids`` and the final usage chunk), which is
  the shape the relay's one-call scan reads (kvtax.delivery.eventscan).

``--only apis`` captures the API bodies alone, leaving the expositions as they are.

``<version>`` is the engine's major.minor from GET /version (e.g. ``0.32``). Run from
the repository root with the sidecar's dev venv::

    .venv/bin/python scripts/capture-fixtures.py [--out tests/fixtures/vllm]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
# The testbed is in kvtax_dev, which no install maps (it is not in the wheel): import it, and
# this checkout's kvtax with it, from exporter/ beside this script.
sys.path.insert(0, str(ROOT / "exporter"))
from kvtax_dev.testbed import VllmEngine  # noqa: E402
from kvtax_dev.testbed.load import PROMPT_TOKENS, drive  # noqa: E402

CONCURRENCY = 64
MAX_TOKENS = 500
POLL_INTERVAL_S = 0.5


@dataclass(frozen=True)
class Snapshot:
    """One /metrics scrape and the few values used to pick the 'preempting' capture."""

    at_s: float
    text: str
    running: float
    waiting: float
    kv_usage: float
    preemptions: float


def _value(text: str, name: str) -> float:
    """Sum of a sample over all its series; plain-text scan keeps the script stdlib+aiohttp."""
    total = 0.0
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            total += float(line.rsplit(" ", 1)[1])
    return total


def _snapshot(text: str, at_s: float) -> Snapshot:
    return Snapshot(
        at_s=at_s,
        text=text,
        running=_value(text, "vllm:num_requests_running"),
        waiting=_value(text, "vllm:num_requests_waiting"),
        kv_usage=_value(text, "vllm:kv_cache_usage_perc"),
        preemptions=_value(text, "vllm:num_preemptions_total"),
    )


async def _scrape(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(f"{url}/metrics") as resp:
        resp.raise_for_status()
        return await resp.text()


async def _overload(url: str, model: str) -> tuple[list[Snapshot], float, int]:
    """Run the overload while polling /metrics; return snapshots, wall time, tokens."""
    snapshots: list[Snapshot] = []
    began = time.monotonic()
    load = asyncio.create_task(
        drive(
            url,
            model,
            concurrency=CONCURRENCY,
            max_tokens=MAX_TOKENS,
            stream=True,
            include_usage=True,
        )
    )
    async with aiohttp.ClientSession() as session:
        while not load.done():
            await asyncio.sleep(POLL_INTERVAL_S)
            text = await _scrape(session, url)
            snapshots.append(_snapshot(text, time.monotonic() - began))
    results = await load
    wall = time.monotonic() - began
    bad = [r for r in results if not r.ok]
    if bad:
        raise SystemExit(f"{len(bad)} requests failed, e.g. {bad[0]}")
    tokens = sum(r.completion_tokens or 0 for r in results)
    return snapshots, wall, tokens


async def _wait_idle(url: str) -> str:
    async with aiohttp.ClientSession() as session:
        while True:
            text = await _scrape(session, url)
            snap = _snapshot(text, 0.0)
            if snap.running == 0 and snap.waiting == 0:
                return text
            await asyncio.sleep(POLL_INTERVAL_S)


def _pick_preempting(snapshots: list[Snapshot]) -> Snapshot:
    candidates = [s for s in snapshots if s.running > 0 and s.waiting > 0 and s.preemptions > 0]
    if not candidates:
        raise SystemExit("no snapshot caught the engine preempting; rerun or poll faster")
    # max() keeps the first of equal KV usage, i.e. the earliest such moment.
    return max(candidates, key=lambda s: s.kv_usage)


# What kvtax adds to a stream by the token_ids scheme (kvtax.delivery.asks.with_usage).
_IDS: dict[str, object] = {"stream_options": {"include_usage": True}, "return_token_ids": True}
# The bodies of each generation API, 12 tokens each (apis/<version>-<name>).
API_BODIES: dict[str, tuple[str, dict[str, object]]] = {
    "messages.sse": ("/v1/messages", {"max_tokens": 12, "stream": True}),
    "messages.json": ("/v1/messages", {"max_tokens": 12}),
    "responses.sse": ("/v1/responses", {"max_output_tokens": 12, "stream": True}),
    "responses.json": ("/v1/responses", {"max_output_tokens": 12}),
    "generate.sse": (
        "/inference/v1/generate",
        {"stream": True, "stream_options": {"include_usage": True}},
    ),
    "generate.json": ("/inference/v1/generate", {}),
    "chat-batch.json": ("/v1/chat/completions/batch", {"max_tokens": 12}),
    "completions-ids.sse": ("/v1/completions", {"max_tokens": 12, "stream": True, **_IDS}),
    "chat-ids.sse": ("/v1/chat/completions", {"max_tokens": 12, "stream": True, **_IDS}),
}


def _api_body(path: str, model: str, more: dict[str, object]) -> dict[str, object]:
    hello = [{"role": "user", "content": "hello there"}]
    if path == "/v1/messages":
        return {"model": model, "messages": hello, **more}
    if path == "/v1/responses":
        return {"model": model, "input": "hello there", **more}
    if path == "/v1/completions":
        return {"model": model, "prompt": "hello there", "ignore_eos": True, **more}
    if path == "/v1/chat/completions":
        return {"model": model, "messages": hello, "ignore_eos": True, **more}
    if path == "/inference/v1/generate":
        params = {"max_tokens": 12, "ignore_eos": True}
        return {"model": model, "token_ids": [5, 6, 7, 8], "sampling_params": params, **more}
    return {"model": model, "messages": [hello, [{"role": "user", "content": "hi"}]], **more}


async def _apis(url: str, model: str) -> dict[str, bytes]:
    bodies: dict[str, bytes] = {}
    async with aiohttp.ClientSession() as session:
        for name, (path, more) in API_BODIES.items():
            async with session.post(url + path, json=_api_body(path, model, more)) as resp:
                resp.raise_for_status()
                bodies[name] = await resp.read()
    return bodies


def _write_apis(out: Path, prefix: str, apis: dict[str, bytes]) -> None:
    (out / "apis").mkdir(exist_ok=True)
    for name, body in apis.items():
        (out / "apis" / f"{prefix}-{name}").write_bytes(body)
        print(out / "apis" / f"{prefix}-{name}")


def _capture_apis(out: Path) -> int:
    with VllmEngine(extra_args=["--enable-scale-out"]) as engine:
        version = json.loads(engine.get("/version"))["version"]
        apis = asyncio.run(_apis(engine.url, engine.model_name))
    _write_apis(out, ".".join(version.split(".")[:2]), apis)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "vllm")
    parser.add_argument(
        "--only",
        choices=["all", "apis"],
        default="all",
        help="apis: capture the API bodies alone, leaving the expositions (default: all)",
    )
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    if args.only == "apis":
        return _capture_apis(out)

    with VllmEngine(extra_args=["--enable-scale-out"]) as engine:
        version = json.loads(engine.get("/version"))["version"]
        prefix = ".".join(version.split(".")[:2])
        idle = engine.metrics_text()
        snapshots, wall, tokens = asyncio.run(_overload(engine.url, engine.model_name))
        preempting = _pick_preempting(snapshots)
        after = asyncio.run(_wait_idle(engine.url))
        apis = asyncio.run(_apis(engine.url, engine.model_name))
        startup = engine.startup_seconds

    (out / f"{prefix}-idle.prom").write_text(idle)
    (out / f"{prefix}-preempting.prom").write_text(preempting.text)
    (out / f"{prefix}-after-overload.prom").write_text(after)
    _write_apis(out, prefix, apis)

    done = _snapshot(after, wall)
    print(
        f"vLLM {version}: startup {startup:.1f} s; overload {CONCURRENCY} x "
        f"({PROMPT_TOKENS} + {MAX_TOKENS}) tokens took {wall:.1f} s, {tokens} tokens, "
        f"{done.preemptions:.0f} preemptions; {len(snapshots)} snapshots polled; "
        f"'preempting' at t={preempting.at_s:.1f} s: running={preempting.running:.0f} "
        f"waiting={preempting.waiting:.0f} kv_usage={preempting.kv_usage:.3f} "
        f"preemptions={preempting.preemptions:.0f}",
        file=sys.stderr,
    )
    for path in sorted(out.glob(f"{prefix}-*.prom")):
        print(path)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
