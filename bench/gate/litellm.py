"""A real LiteLLM proxy in front of the real vLLM CPU engine, with kvtax reading LiteLLM's
Prometheus counter through ``--gateway.url`` (issue 24, item 7).

Starts the testbed engine (``tiny-llama``), LiteLLM's proxy from its own venv
(``scripts/setup-litellm.sh``) with its ``prometheus`` callback, and ``kvtax serve`` with the
proxy off and ``--gateway.url`` at LiteLLM's ``/metrics/``. Clients talk to LiteLLM only, under a
public alias (``chat-small``) that LiteLLM routes to ``hosted_vllm/tiny-llama``, so the check also
shows which of LiteLLM's labels carries the engine's model name. Phases, each sent through
LiteLLM and then waited for in kvtax's ``kvtax_delivered_tokens_total{source="gateway"}``:

- chat, not streamed;
- chat, streamed with ``stream_options.include_usage``;
- completions, not streamed;
- completions, streamed with ``stream_options.include_usage``;
- chat, streamed without ``stream_options`` (the client sees no usage, so this phase is compared
  with the engine's own ``vllm:generation_tokens_total`` increase instead).

For every phase it prints and records: the clients' summed ``usage.completion_tokens``, kvtax's
gateway-delivered increase under the engine's model name, and the engine's generation-token
increase. It fails (exit 1) unless delivered equals the clients' usage in every phase with
usage, and nothing lands under any other model name. It writes the numbers as JSON
(``--out``) and LiteLLM's final ``/metrics/`` page (``--page``), the fixture behind
tests/unit/test_gateway_litellm.py.

Two facts of LiteLLM 1.108 shape the setup (bench/results/gateway-litellm.md has the evidence):
it refuses to start without a master key, and its ``/metrics`` then demands that key too, which
kvtax's poller cannot send, so the config sets ``require_auth_for_metrics_endpoint: false``; and
``/metrics`` answers 307 to ``/metrics/``, which kvtax does not follow, so the URL ends in a slash.

Run from the repository root, under the end-to-end lock (about 3 minutes, most of it the
engine's start)::

    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.gate.litellm
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import requests

from bench import record
from kvtax_dev import repo_root
from kvtax_dev.exposition import read_samples, total
from kvtax_dev.process import ChildProcess, ChildStartError, http_ok, poll_until
from kvtax_dev.testbed import VllmEngine, free_port
from kvtax_dev.testbed.load import PROMPT
from kvtax_dev.testbed.sidecar import KvtaxProcess

ALIAS = "chat-small"
SETTLE_TIMEOUT_S = 60.0


def litellm_venv() -> Path:
    script = repo_root() / "scripts" / "setup-litellm.sh"
    out = subprocess.run([str(script)], check=True, capture_output=True, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def litellm_version(venv: Path) -> str:
    code = "import importlib.metadata as m; print(m.version('litellm'))"
    out = subprocess.run(
        [str(venv / "bin" / "python"), "-c", code], check=True, capture_output=True, text=True
    )
    return out.stdout.strip()


def litellm_config(engine_url: str, engine_model: str, master_key: str) -> str:
    """LiteLLM's proxy config: one alias routed to the engine, Prometheus on, /metrics open."""
    return json.dumps(  # JSON is YAML
        {
            "model_list": [
                {
                    "model_name": ALIAS,
                    "litellm_params": {
                        "model": f"hosted_vllm/{engine_model}",
                        "api_base": f"{engine_url}/v1",
                        "api_key": "none",
                    },
                }
            ],
            "litellm_settings": {
                "callbacks": ["prometheus"],
                # kvtax's poller sends no Authorization header.
                "require_auth_for_metrics_endpoint": False,
            },
            "general_settings": {"master_key": master_key},
        },
        indent=2,
    )


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    chat: bool
    stream: bool
    include_usage: bool


PHASES = (
    Phase("chat, not streamed", chat=True, stream=False, include_usage=False),
    Phase("chat, streamed, include_usage", chat=True, stream=True, include_usage=True),
    Phase("completions, not streamed", chat=False, stream=False, include_usage=False),
    Phase("completions, streamed, include_usage", chat=False, stream=True, include_usage=True),
    Phase("chat, streamed, no stream_options", chat=True, stream=True, include_usage=False),
)


@dataclass(frozen=True, slots=True)
class Answer:
    status: int
    completion_tokens: int | None
    error: str | None


async def _ask(
    session: aiohttp.ClientSession, base: str, phase: Phase, max_tokens: int, seed: int
) -> Answer:
    body: dict[str, Any] = {
        "model": ALIAS,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "ignore_eos": True,  # vLLM's extension; LiteLLM's hosted_vllm passes it on
        "seed": seed,
        "stream": phase.stream,
    }
    if phase.chat:
        body["messages"] = [{"role": "user", "content": PROMPT}]
    else:
        body["prompt"] = PROMPT
    if phase.stream and phase.include_usage:
        body["stream_options"] = {"include_usage": True}
    path = "/v1/chat/completions" if phase.chat else "/v1/completions"
    usage: dict[str, Any] | None = None
    try:
        async with session.post(base + path, json=body) as resp:
            if resp.status != 200:
                return Answer(resp.status, None, (await resp.text())[:300])
            if not phase.stream:
                usage = (await resp.json()).get("usage")
            else:
                async for raw in resp.content:
                    line = raw.decode().strip()
                    if not line.startswith("data:") or line == "data: [DONE]":
                        continue
                    usage = json.loads(line[5:]).get("usage") or usage
    except (TimeoutError, aiohttp.ClientError, ValueError) as exc:
        return Answer(0, None, f"{type(exc).__name__}: {exc}")
    tokens = None if usage is None else usage.get("completion_tokens")
    return Answer(200, tokens, None)


async def send(
    base: str, key: str, phase: Phase, *, n: int, concurrency: int, max_tokens: int
) -> list[Answer]:
    gate = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {key}"}
    timeout = aiohttp.ClientTimeout(total=300)
    connector = aiohttp.TCPConnector(limit=0, force_close=True)
    async with aiohttp.ClientSession(headers=headers, timeout=timeout, connector=connector) as s:

        async def one(i: int) -> Answer:
            async with gate:
                return await _ask(s, base, phase, max_tokens, seed=i)

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def delivered(page: dict[str, float], model: str, source: str = "gateway") -> float:
    key = f'kvtax_delivered_tokens_total{{model_name="{model}",source="{source}"}}'
    return page.get(key, 0.0)


def delivered_elsewhere(page: dict[str, float], model: str) -> dict[str, float]:
    """kvtax_delivered_tokens_total series under any other model or source."""
    mine = f'kvtax_delivered_tokens_total{{model_name="{model}",source="gateway"}}'
    return {
        k: v
        for k, v in page.items()
        if k.startswith("kvtax_delivered_tokens_total{") and k != mine and v
    }


def generation_tokens(engine: VllmEngine) -> float:
    return total(read_samples(engine.metrics_text()), "vllm:generation_tokens_total")


def settle(read: Callable[[], float], target: float | None, timeout: float) -> float:
    """Poll ``read`` until it equals ``target`` (or, without one, stops moving for 3 s)."""
    last = [read(), time.monotonic()]

    def done() -> bool | None:
        value = read()
        if target is not None:
            return True if value == target else None
        if value != last[0]:
            last[:] = [value, time.monotonic()]
            return None
        return True if time.monotonic() - last[1] >= 3.0 else None

    poll_until(done, timeout=timeout, interval=0.5)
    return read()


def run(args: argparse.Namespace) -> int:
    venv = litellm_venv()
    version = litellm_version(venv)
    print(f"litellm {version} in {venv}", file=sys.stderr)
    work = Path(tempfile.mkdtemp(prefix="kvtax-litellm-"))
    master_key = "sk-" + secrets.token_hex(24)
    results: list[dict[str, Any]] = []
    failures: list[str] = []
    with VllmEngine(num_gpu_blocks=args.blocks) as engine:
        model = engine.model_name
        (work / "config.yaml").write_text(litellm_config(engine.url, model, master_key))
        port = free_port()
        base = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "LITELLM_LOCAL_MODEL_COST_MAP": "True",  # no network: read the bundled cost map
            "LITELLM_TELEMETRY": "False",
        }
        litellm = ChildProcess(
            "LiteLLM",
            [
                str(venv / "bin" / "litellm"),
                "--config",
                str(work / "config.yaml"),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--num_workers",
                "1",
            ],
            log_path=work / "litellm.log",
            ready=lambda: http_ok(f"{base}/health/liveliness"),
            env=env,
            cwd=work,
            own_group=True,
            startup_timeout=180.0,
            error=ChildStartError,
        )
        began = time.monotonic()
        with litellm:
            print(f"LiteLLM ready after {time.monotonic() - began:.1f} s", file=sys.stderr)
            gateway_url = f"{base}/metrics/"
            kvtax = KvtaxProcess(
                engine.url,
                proxy=False,
                extra_args=[f"--gateway.url={gateway_url}"],
                log_path=work / "kvtax.log",
            )
            with kvtax:
                for phase in PHASES:
                    engine.wait_idle()
                    before_d = delivered(kvtax.metrics(), model)
                    before_g = generation_tokens(engine)
                    answers = asyncio.run(
                        send(
                            base,
                            master_key,
                            phase,
                            n=args.requests,
                            concurrency=args.concurrency,
                            max_tokens=args.tokens,
                        )
                    )
                    errors = [a.error for a in answers if a.error]
                    usage = [a.completion_tokens for a in answers if a.status == 200]
                    with_usage = phase.include_usage or not phase.stream
                    client = float(sum(u or 0 for u in usage)) if with_usage else None
                    engine.wait_idle()
                    engine_g = settle(lambda: generation_tokens(engine), None, 30.0) - before_g
                    target = before_d + (client if client is not None else engine_g)
                    after_d = settle(
                        lambda: delivered(kvtax.metrics(), model), target, SETTLE_TIMEOUT_S
                    )
                    row = {
                        "phase": phase.name,
                        "requests": len(answers),
                        "ok": len(usage),
                        "errors": errors[:3],
                        "clients_usage_completion_tokens": client,
                        "clients_without_usage": sum(1 for u in usage if u is None),
                        "kvtax_gateway_delivered": after_d - before_d,
                        "engine_generation_tokens": engine_g,
                    }
                    results.append(row)
                    print(json.dumps(row), file=sys.stderr)
                    if errors:
                        failures.append(f"{phase.name}: {len(errors)} request(s) failed")
                    if client is not None and after_d - before_d != client:
                        failures.append(
                            f"{phase.name}: kvtax delivered {after_d - before_d:g}, "
                            f"clients' usage {client:g}"
                        )
                page = kvtax.metrics()
                stray = delivered_elsewhere(page, model)
                if stray:
                    failures.append(f"delivered tokens under other series: {stray}")
                litellm_page = requests.get(gateway_url, timeout=10).text
                kvtax_gateway_log = [
                    line for line in kvtax.log_tail(200).splitlines() if "gateway" in line
                ]
    report = {
        "litellm_version": version,
        "engine_model": model,
        "litellm_alias": ALIAS,
        "gateway_url_path": "/metrics/",
        "requests_per_phase": args.requests,
        "concurrency": args.concurrency,
        "max_tokens": args.tokens,
        "phases": results,
        "stray_delivered_series": stray,
        "kvtax_gateway_log_lines": kvtax_gateway_log[-5:],
        "failures": failures,
    }
    if args.out:
        # The JSON alone: results/gateway-litellm.md is written by hand around these figures.
        record.save(args.out, None, report)
    if args.page:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(_trim(litellm_page))
    print(json.dumps(report, indent=2))
    for failure in failures:
        print(f"FAIL: {failure}", file=sys.stderr)
    return 1 if failures else 0


def _trim(page: str) -> str:
    """LiteLLM's page without the process/GC families, which vary from run to run."""
    keep: list[str] = []
    for line in page.splitlines():
        name = line.split(" ")[2] if line.startswith("# ") and len(line.split(" ")) > 2 else line
        if name.startswith(("python_", "process_")):
            continue
        keep.append(line)
    return "\n".join(keep) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=12, help="requests per phase")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="max_tokens (ignore_eos)")
    parser.add_argument("--blocks", type=int, default=64, help="engine KV blocks")
    parser.add_argument("--out", type=Path, default=Path("bench/results/gateway-litellm.json"))
    parser.add_argument(
        "--page", type=Path, default=Path("tests/fixtures/litellm/1.108-metrics.prom")
    )
    return run(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
