"""Benchmark: kvtax's scrape pipeline against prometheus-client's parser alone, side by side.

Each repetition times the same body twice, in alternating order: once through the bare parser
(``text_string_to_metric_families``, fully iterated), and once through kvtax's whole pipeline.
The pipeline is ``ScrapeJob.ingest`` of the stack ``serve.wiring.build`` connects (normalize,
the window with the ledger's totals, derive) plus ``generate_latest`` of kvtax's registry (the
web port's). It reports
medians, the ratio pipeline / bare parse, and the peak Python allocation of one pass of each
(tracemalloc). Two payloads are used:

- ``30 models``: a page of 1 MB or more, generated from the real 0.32 capture by replicating
  every per-model family over 30 model names. Histograms are included;
- ``0.32 capture``: the real capture ``tests/fixtures/vllm/0.32-preempting.prom``.

The pipeline is measured in steady state: the window is filled first, with 61 points at
a 5 s step in a 5 m window, as with the defaults. Last, a real ``kvtax serve`` process scrapes the
30-model page from a loopback HTTP server. Its VmRSS and VmHWM are read from /proc.

Run from the repository root::

    .venv/bin/python -m bench.scrape.pipeline            # full run, about two minutes
    .venv/bin/python -m bench.scrape.pipeline --quick    # fewer repetitions, shorter RSS phase
"""

from __future__ import annotations

import argparse
import gc
import http.server
import itertools
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
import tracemalloc
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench import procfs, record
from bench.net import free_port
from kvtax.serve.config import OPTIONS, Config
from kvtax.serve.wiring import build

__all__ = ["bare_parse", "main", "multi_model_payload"]

ROOT = Path(__file__).resolve().parents[2]
CAPTURE = ROOT / "tests" / "fixtures" / "vllm" / "0.32-preempting.prom"
MODELS = 30
STEP = 5.0  # seconds between simulated scrapes, as with the default interval
WINDOW = 300.0
WARM_SCRAPES = int(WINDOW / STEP) + 1  # fills the window: 61 points

_MODEL_LABEL = re.compile(r'model_name="[^"]*"')


def multi_model_payload(capture: str, models: int) -> str:
    """The capture with every family that has a ``model_name`` replicated over ``models`` names.

    Families are kept whole (HELP, TYPE, then all samples), so the page stays valid text.
    Server-wide families such as ``python_*`` and ``http_requests_total`` appear once.
    """
    out: list[str] = []
    block: list[str] = []

    def flush() -> None:
        header = [line for line in block if line.startswith("#")]
        samples = [line for line in block if not line.startswith("#")]
        out.extend(header)
        if any(_MODEL_LABEL.search(line) for line in samples):
            for i in range(models):
                name = f'model_name="team-{i:02d}/Llama-3.1-8B-Instruct"'
                out.extend(_MODEL_LABEL.sub(name, line) for line in samples)
        else:
            out.extend(samples)
        block.clear()

    for line in capture.splitlines():
        if line.startswith("# HELP") and block:
            flush()
        block.append(line)
    if block:
        flush()
    return "\n".join(out) + "\n"


def bare_parse(text: str) -> int:
    """prometheus-client's parser alone, every sample touched. Returns the sample count."""
    count = 0
    for family in text_string_to_metric_families(text):
        for _ in family.samples:
            count += 1
    return count


_MONOTONIC = re.compile(
    r"^(?P<series>[^#\s{]+(?:_bucket|_count|_sum|_total)(?:\{[^}]*\})?) (?P<value>\S+)$",
    re.MULTILINE,
)


def advancing_pages(text: str, count: int) -> list[str]:
    """``count`` pages where every counter and histogram series has grown by 1, 2, 3, ...

    A live engine's histograms change on every scrape; a page served unchanged would flatter
    the window, which reuses a point's objects when nothing changed.
    """

    def page(step: int) -> str:
        def bump(match: re.Match[str]) -> str:
            return f"{match['series']} {float(match['value']) + step!r}"

        return _MONOTONIC.sub(bump, text)

    return [page(i) for i in range(count)]


class Pipeline:
    """kvtax's scrape path over successive pages, with the window kept between calls."""

    def __init__(self, pages: list[str]) -> None:
        self.pages = pages
        stack = build(Config(window=WINDOW))
        self.scrape, self.web = stack.scrape, stack.web
        self.scrapes = 0

    def warm(self) -> None:
        for _ in range(WARM_SCRAPES):
            self()

    @property
    def text(self) -> str:
        """The page the next call ingests."""
        return self.pages[self.scrapes % len(self.pages)]

    def __call__(self) -> int:
        text = self.text
        self.scrapes += 1
        self.scrape.ingest(text, self.scrapes * STEP)
        return len(generate_latest(self.web.registry))


@dataclass(frozen=True)
class Row:
    payload: str
    size_bytes: int
    samples: int
    bare_ms: float
    pipeline_ms: float
    ratio_of_minima: float
    bare_peak_mib: float
    pipeline_peak_mib: float

    @property
    def ratio(self) -> float:
        return self.pipeline_ms / self.bare_ms

    @property
    def memory_ratio(self) -> float:
        return self.pipeline_peak_mib / self.bare_peak_mib


def _timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return (time.perf_counter() - start) * 1000


def _peak_mib(fn: Callable[[], object]) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        tracemalloc.reset_peak()
        base, _ = tracemalloc.get_traced_memory()
        fn()
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    return (peak - base) / 2**20


def measure(name: str, text: str, repetitions: int) -> Row:
    # One page per scrape, counters growing; the bare parse reads the very same page.
    pipeline = Pipeline(advancing_pages(text, WARM_SCRAPES + repetitions + 2))
    pipeline.warm()
    bare_fn = lambda: bare_parse(pipeline.text)  # noqa: E731
    samples = bare_parse(text)
    bare: list[float] = []
    piped: list[float] = []
    for rep in range(repetitions):
        # Alternate which goes first, so neither always runs on a warmer cache.
        if rep % 2 == 0:
            bare.append(_timed(bare_fn))
            piped.append(_timed(pipeline))
        else:
            piped.append(_timed(pipeline))
            bare.append(_timed(bare_fn))
    return Row(
        payload=name,
        size_bytes=len(text.encode()),
        samples=samples,
        bare_ms=statistics.median(bare),
        pipeline_ms=statistics.median(piped),
        ratio_of_minima=min(piped) / min(bare),
        bare_peak_mib=_peak_mib(bare_fn),
        pipeline_peak_mib=_peak_mib(pipeline),
    )


# -- RSS of a real `kvtax serve` ----------------------------------------------------------------


@contextmanager
def serve_payload(pages: list[str]) -> Iterator[str]:
    """A loopback HTTP server standing in for vLLM: each GET /metrics gets the next page."""
    bodies = [page.encode() for page in pages]
    served = itertools.count()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            if self.path == "/metrics":
                body = bodies[min(next(served), len(bodies) - 1)]
                payload, ctype = body, "text/plain; version=0.0.4"
            elif self.path == "/version":
                payload, ctype = b'{"version": "0.32.0"}', "application/json"
            else:
                self.send_error(404)
                return
            self.send_response(200)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def log_message(self, format: str, *args: object) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()


def _kvtax_value(url: str, name: str) -> float | None:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            text = resp.read().decode()
    except OSError:
        return None
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and not sample.labels:
                return float(sample.value)
    return None


@dataclass(frozen=True)
class RssResult:
    scrapes: int
    up: float
    rss_mib: float
    hwm_mib: float
    seconds: float


MIB = 1024 * 1024


def measure_rss(text: str, seconds: float, interval: float) -> RssResult:
    """Run ``kvtax serve`` against the payload for ``seconds`` and read its memory."""
    script = Path(sys.executable).parent / "kvtax"
    port = free_port()
    # A window of 61 points, as the defaults keep (5 m at 5 s), reached sooner at a 1 s interval.
    window = f"{interval * 60:g}s"
    pages = advancing_pages(text, int(seconds / interval) + 20)
    with serve_payload(pages) as vllm_url:
        args = [
            str(script),
            "serve",
            f"--vllm.url={vllm_url}",
            f"--scrape.interval={interval:g}s",
            f"--window={window}",
            f"--web.listen-address=127.0.0.1:{port}",
        ]
        if any(o.key == "proxy.listen_address" for o in OPTIONS):
            args.append("--proxy.listen-address=off")
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVTAX_")}
        proc = subprocess.Popen(
            args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
        )
        try:
            started = time.monotonic()
            while time.monotonic() - started < seconds:
                if proc.poll() is not None:
                    raise RuntimeError(f"kvtax serve exited early: {proc.stderr.read()}")  # type: ignore[union-attr]
                time.sleep(1.0)
            metrics_url = f"http://127.0.0.1:{port}/metrics"
            scrapes = _kvtax_value(metrics_url, "kvtax_scrapes_total") or 0.0
            up = _kvtax_value(metrics_url, "kvtax_vllm_up") or 0.0
            rss, hwm = procfs.rss_bytes([proc.pid]), procfs.peak_rss_bytes([proc.pid])
            elapsed = time.monotonic() - started
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
    return RssResult(int(scrapes), up, rss / MIB, hwm / MIB, elapsed)


# -- report -------------------------------------------------------------------------------------


COLUMNS = ["payload", "size", "samples", "bare parse (median)", "pipeline (median)", "ratio"]
COLUMNS += ["ratio of minima", "bare peak alloc", "pipeline peak alloc"]


def _table(rows: list[Row]) -> str:
    return record.table(COLUMNS, [_cells(r) for r in rows], "l" + "r" * 8)


def _cells(r: Row) -> list[str]:
    return [
        r.payload,
        f"{r.size_bytes / 1e6:.2f} MB",
        f"{r.samples:,}",
        f"{r.bare_ms:.1f} ms",
        f"{r.pipeline_ms:.1f} ms",
        f"**{r.ratio:.2f}x**",
        f"{r.ratio_of_minima:.2f}x",
        f"{r.bare_peak_mib:.1f} MiB",
        f"{r.pipeline_peak_mib:.1f} MiB",
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="fewer repetitions, short RSS run")
    parser.add_argument("--no-rss", action="store_true", help="skip the kvtax serve RSS phase")
    args = parser.parse_args(argv)

    capture = CAPTURE.read_text()
    big = multi_model_payload(capture, MODELS)
    if len(big.encode()) < 1_000_000:
        raise SystemExit(f"generated payload is only {len(big.encode())} bytes; expected >= 1 MB")
    reps_big, reps_small = (5, 15) if args.quick else (21, 61)
    print(
        f"python {sys.version.split()[0]}, {os.cpu_count()} CPUs; interleaved repetitions: "
        f"{reps_big} (30 models), {reps_small} (0.32 capture)",
        flush=True,
    )
    rows = [
        measure(f"{MODELS} models", big, reps_big),
        measure("0.32 capture", capture, reps_small),
    ]
    print()
    print(_table(rows))
    target = all(r.ratio <= 1.5 for r in rows)
    print(f"\npipeline <= 1.5x bare parse: {'yes' if target else 'NO'}")

    if not args.no_rss:
        seconds, interval = (20.0, 1.0) if args.quick else (75.0, 1.0)
        print(
            f"\nkvtax serve on the {MODELS}-model page, {interval:g}s interval, {seconds:g}s ...",
            flush=True,
        )
        rss = measure_rss(big, seconds, interval)
        mib = [f"{rss.rss_mib:.1f} MiB", f"{rss.hwm_mib:.1f} MiB"]
        header = ["scrapes", "kvtax_vllm_up", "VmRSS", "VmHWM (peak RSS)"]
        print(record.table(header, [[str(rss.scrapes), f"{rss.up:g}", *mib]], "rrrr"))
        print(f"\nsidecar RSS < 80 MB: {'yes' if rss.hwm_mib * 2**20 < 80e6 else 'NO'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
