"""Benchmark: a real ``kvtax serve`` in front of a hostile vLLM stand-in (issue 10, findings 7, 8).

A loopback server (this module with ``--serve``, in its own process) stands in for vLLM: its
``/metrics`` answers one scenario's page and its ``/v1/completions`` streams like
``bench.relay.sse_upstream`` (100 chunks, 10 ms apart). ``kvtax serve`` scrapes it every 5 s (the
default) and relays streams to it through its proxy. For each scenario the benchmark measures,
for ``--seconds``:

- ``/healthz`` latency, probed every 50 ms;
- the relayed streams' stall: two streams at a time through kvtax's proxy, the largest gap
  between chunks minus the 10 ms pacing;
- peak RSS of kvtax and its children (the parse worker), sampled every 50 ms and summed, and
  the sum of their VmHWM, read from /proc;
- what kvtax published at the end: up, scrapes, errors by reason, its own series count.

Scenarios: ``capture`` (the real 0.32 page, the control), ``51mb`` (a valid 51 MB page of 1,250
models, sent chunked with no Content-Length, so kvtax must read until its byte bound),
``bounds`` (100 models, 42,000 series, 4.1 MB: the largest page the default bounds accept, so it
is parsed at every scrape) and ``rotating`` (10,000 model names, 2,000 per page, new names at
every scrape).

Run from the repository root::

    .venv/bin/python -m bench.scrape.bigpage                       # this tree, writes results
    .venv/bin/python -m bench.scrape.bigpage --label before --kvtax-path /tmp/kvtax-base/exporter

``--kvtax-path`` runs the kvtax package found there (e.g. a ``git worktree`` of an older
commit) with this venv's Python. Each label's figures go to ``bench/results/bigpage-LABEL.json``;
``bench/results/bigpage.md`` is rendered from all of them.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

import aiohttp
import requests
from aiohttp import web

from bench import procfs, record
from bench.net import free_port
from bench.scrape.pipeline import CAPTURE, multi_model_payload
from bench.stats import quantile
from kvtax_dev import EXPORTER
from kvtax_dev.exposition import read_samples
from kvtax_dev.fakevllm.fast import completions
from kvtax_dev.process import ChildProcess, port_open

__all__ = ["SCENARIOS", "main"]

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "bench" / "results"
SCENARIOS = ("capture", "51mb", "bounds", "rotating")
# The kvtax container's memory limit in deploy/components/kvtax-sidecar and the chart.
POD_LIMIT_MIB = 256
CHUNKS, PACING = 100, 0.010
ROTATING_NAMES, ROTATING_PER_PAGE = 10_000, 2_000


# -- the vLLM stand-in (runs in its own process) ------------------------------------------------


def _rotating_pages() -> list[bytes]:
    """Pages of 2,000 models each, 10,000 names in all, six vLLM series per model."""
    pages = []
    for start in range(0, ROTATING_NAMES, ROTATING_PER_PAGE):
        names = [f"rot-{i:05d}" for i in range(start, start + ROTATING_PER_PAGE)]
        lines: list[str] = []
        for family, kind, value in (
            ("vllm:generation_tokens_total", "counter", 1000),
            ("vllm:prompt_tokens_total", "counter", 4000),
            ("vllm:num_preemptions_total", "counter", 3),
            ("vllm:num_requests_running", "gauge", 2),
            ("vllm:num_requests_waiting", "gauge", 1),
            ("vllm:kv_cache_usage_perc", "gauge", 0.5),
        ):
            lines.append(f"# TYPE {family.removesuffix('_total')} {kind}")
            lines += [f'{family}{{engine="0",model_name="{n}"}} {value}' for n in names]
        pages.append(("\n".join(lines) + "\n").encode())
    return pages


def scenario_pages(name: str) -> list[bytes]:
    capture = CAPTURE.read_text()
    if name == "capture":
        return [capture.encode()]
    if name == "51mb":
        return [multi_model_payload(capture, 1250).encode()]
    if name == "bounds":
        return [multi_model_payload(capture, 100).encode()]
    if name == "rotating":
        return _rotating_pages()
    raise ValueError(f"unknown scenario {name!r}")


def serve(name: str, port: int) -> None:
    pages = scenario_pages(name)
    served = 0

    async def metrics(request: web.Request) -> web.StreamResponse:
        nonlocal served
        body = pages[served % len(pages)]
        served += 1
        if name != "51mb":
            return web.Response(body=body, content_type="text/plain")
        resp = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await resp.prepare(request)  # chunked, in 256 KiB writes: no Content-Length to refuse
        with contextlib.suppress(ConnectionError):
            for i in range(0, len(body), 1 << 18):
                await resp.write(body[i : i + (1 << 18)])
            await resp.write_eof()
        return resp

    async def version(request: web.Request) -> web.Response:
        return web.json_response({"version": "0.32.0"})

    app = web.Application()
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/version", version)
    app.router.add_post("/v1/completions", completions)
    web.run_app(app, host="127.0.0.1", port=port, access_log=None, print=None)


# -- processes ---------------------------------------------------------------------------------


@contextlib.contextmanager
def running(args: list[str], log: Path, port: int, env: dict[str, str]) -> Iterator[int]:
    """The child running, once something listens on ``port``; yields its pid."""
    child = ChildProcess(
        log.stem,
        args,
        log_path=log,
        ready=lambda: port_open(port),
        env=env,
        startup_timeout=120,
    )
    with child:
        assert child.pid is not None
        yield child.pid


# -- probes ------------------------------------------------------------------------------------


@dataclass
class Probes:
    healthz: list[float] = field(default_factory=list)
    healthz_failures: int = 0
    gaps: list[float] = field(default_factory=list)
    streams: int = 0
    stream_failures: int = 0
    peak_rss_kib: int = 0


async def _probe_healthz(session: aiohttp.ClientSession, url: str, p: Probes) -> None:
    while True:
        started = time.perf_counter()
        try:
            async with session.get(url + "/healthz") as resp:
                await resp.read()
                ok = resp.status == 200
        except (aiohttp.ClientError, TimeoutError):
            ok = False
        p.healthz.append(time.perf_counter() - started)
        p.healthz_failures += not ok
        await asyncio.sleep(0.05)


async def _probe_stream(session: aiohttp.ClientSession, url: str, p: Probes) -> None:
    body = {"model": "bench", "prompt": "x", "stream": True, "max_tokens": CHUNKS}
    body["bench_interval"] = PACING
    while True:
        last: float | None = None
        try:
            async with session.post(url + "/v1/completions", json=body) as resp:
                async for _ in resp.content.iter_any():
                    now = time.perf_counter()
                    if last is not None:
                        p.gaps.append(now - last)
                    last = now
            p.streams += 1
        except (aiohttp.ClientError, TimeoutError):
            p.stream_failures += 1
            await asyncio.sleep(0.1)


async def _sample_rss(pid: int, p: Probes) -> None:
    while True:
        p.peak_rss_kib = max(p.peak_rss_kib, procfs.rss_bytes([pid, *procfs.children(pid)]) // 1024)
        await asyncio.sleep(0.05)


async def probe(pid: int, web_url: str, proxy_url: str, seconds: float) -> Probes:
    p = Probes()
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        tasks = [
            asyncio.create_task(_probe_healthz(session, web_url, p)),
            asyncio.create_task(_probe_stream(session, proxy_url, p)),
            asyncio.create_task(_probe_stream(session, proxy_url, p)),
            asyncio.create_task(_sample_rss(pid, p)),
        ]
        await asyncio.sleep(seconds)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return p


def _kvtax_page(url: str) -> dict[str, float]:
    resp = requests.get(url + "/metrics", timeout=60)
    resp.raise_for_status()
    samples = read_samples(resp.content.decode())
    out: dict[str, float] = {"series": float(sum(len(v) for v in samples.values()))}
    for labels, value in samples.get("kvtax_scrape_errors_total", {}).items():
        if value:
            out[f"errors:{dict(labels).get('reason')}"] = value
    for name in ("kvtax_vllm_up", "kvtax_scrapes_total", "kvtax_scrape_dropped_models_total"):
        for value in samples.get(name, {}).values():
            out[name] = value
    return out


# -- one scenario ------------------------------------------------------------------------------


@dataclass
class Result:
    label: str
    scenario: str
    page_mb: float
    healthz_p50_ms: float
    healthz_p99_ms: float
    healthz_max_ms: float
    healthz_failures: int
    stall_max_ms: float
    gap_p99_ms: float
    streams: int
    stream_failures: int
    peak_rss_mib: float
    hwm_mib: float
    kvtax: dict[str, float]


def _kvtax_args(web_port: int, proxy_port: int, vllm_port: int) -> list[str]:
    return [
        sys.executable,
        "-m",
        "kvtax.cli.main",
        "serve",
        f"--vllm.url=http://127.0.0.1:{vllm_port}",
        f"--web.listen-address=127.0.0.1:{web_port}",
        f"--proxy.listen-address=127.0.0.1:{proxy_port}",
        "--log.level=warning",
    ]


def run_scenario(name: str, label: str, seconds: float, kvtax_path: str | None) -> Result:
    page_mb = max(len(p) for p in scenario_pages(name)) / 1e6
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVTAX_")}
    # This checkout's kvtax unless told otherwise: the venv's install may map another tree.
    env["PYTHONPATH"] = os.pathsep.join((kvtax_path or str(EXPORTER), str(ROOT)))
    work = Path(tempfile.mkdtemp(prefix="kvtax-bigpage-"))
    vllm_port, web_port, proxy_port = free_port(), free_port(), free_port()
    serve_args = [
        sys.executable,
        "-m",
        "bench.scrape.bigpage",
        "--serve",
        name,
        f"--port={vllm_port}",
    ]
    with running(serve_args, work / "vllm.log", vllm_port, env):
        kvtax_args = _kvtax_args(web_port, proxy_port, vllm_port)
        with running(kvtax_args, work / "kvtax.log", web_port, env) as pid:
            web_url = f"http://127.0.0.1:{web_port}"
            probes = asyncio.run(probe(pid, web_url, f"http://127.0.0.1:{proxy_port}", seconds))
            hwm = procfs.peak_rss_bytes([pid, *procfs.children(pid)]) // 1024
            page = _kvtax_page(web_url)
    shutil.rmtree(work)  # kept only when a run fails: the logs are in it
    return Result(
        label=label,
        scenario=name,
        page_mb=page_mb,
        healthz_p50_ms=statistics.median(probes.healthz) * 1e3,
        healthz_p99_ms=quantile(probes.healthz, 0.99) * 1e3,
        healthz_max_ms=max(probes.healthz) * 1e3,
        healthz_failures=probes.healthz_failures,
        stall_max_ms=(max(probes.gaps, default=float("nan")) - PACING) * 1e3,
        gap_p99_ms=quantile(probes.gaps, 0.99) * 1e3,
        streams=probes.streams,
        stream_failures=probes.stream_failures,
        peak_rss_mib=probes.peak_rss_kib / 1024,
        hwm_mib=hwm / 1024,
        kvtax=page,
    )


# -- the report --------------------------------------------------------------------------------

_HEAD = """# bench.scrape.bigpage: kvtax under hostile vLLM pages

Generated by `.venv/bin/python -m bench.scrape.bigpage` (see the module docstring for the method).
Acceptance (issue 10): `/healthz` within 100 ms and relayed streams stalling less than 100 ms
while vLLM serves a 51 MB page or 10,000 rotating model names, and RSS under the pod's
{limit} MiB limit. RSS is kvtax plus its parse worker: the peak of their sampled sum, and the
sum of each one's own peak (VmHWM), an upper bound.

"""
_COLUMNS = (
    "run",
    "scenario",
    "page",
    "/healthz p50 / p99 / max",
    "failed",
    "stream stall max",
    "gap p99",
    "streams",
    "peak RSS",
    "VmHWM sum",
    "up",
    "scrapes",
    "scrape errors",
    "kvtax series",
)
_ALIGN = "llrrrrrrrrrrlr"


def _cells(r: Result) -> tuple[str, ...]:
    errors = ", ".join(
        f"{k.removeprefix('errors:')} {v:g}" for k, v in sorted(r.kvtax.items()) if "errors:" in k
    )
    return (
        r.label,
        r.scenario,
        f"{r.page_mb:.1f} MB",
        f"{r.healthz_p50_ms:.1f} / {r.healthz_p99_ms:.1f} / **{r.healthz_max_ms:.0f}** ms",
        f"{r.healthz_failures}",
        f"**{r.stall_max_ms:.0f} ms**",
        f"{r.gap_p99_ms:.1f} ms",
        f"{r.streams} ({r.stream_failures} failed)",
        f"**{r.peak_rss_mib:.0f} MiB**",
        f"{r.hwm_mib:.0f} MiB",
        f"{r.kvtax.get('kvtax_vllm_up', float('nan')):g}",
        f"{r.kvtax.get('kvtax_scrapes_total', float('nan')):g}",
        errors or "-",
        f"{r.kvtax.get('series', 0):g}",
    )


def render() -> str:
    rows: list[tuple[str, ...]] = []
    notes: list[str] = []
    for path in sorted(RESULTS.glob("bigpage-*.json"), reverse=True):
        data = json.loads(path.read_text())
        rows += [_cells(Result(**r)) for r in data["results"]]
        notes.append(f"- `{data['label']}`: {data['note']}")
    body = record.table(_COLUMNS, rows, _ALIGN)
    return _HEAD.format(limit=POD_LIMIT_MIB) + body + "\n\n" + "\n".join(notes) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--serve", choices=SCENARIOS, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--label", default="after")
    parser.add_argument("--note", default="this tree")
    parser.add_argument("--kvtax-path", help="directory holding the kvtax package to run")
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = parser.parse_args()
    if args.serve:
        serve(args.serve, args.port)
        return
    results = []
    for name in args.scenarios.split(","):
        result = run_scenario(name, args.label, args.seconds, args.kvtax_path)
        print(" | ".join(_cells(result)), flush=True)
        results.append(asdict(result))
    figures = {"label": args.label, "note": args.note, "results": results}
    record.save(RESULTS / f"bigpage-{args.label}", None, figures)
    record.save(RESULTS / "bigpage", render(), None)
    print(render())


if __name__ == "__main__":
    main()
