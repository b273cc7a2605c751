"""Benchmark: what a fleet of kvtax sidecars costs Prometheus, in series and rule-evaluation time.

Two parts, one command:

1. **Series one sidecar exports** (in process, no servers). A real ``kvtax serve`` stack
   (``serve.wiring.build``) ingests the real vLLM 0.32 capture replicated over 1, 2 and 4
   models, with one settled request per model through the ledger (so the delivery histograms
   exist) and 0 or 1 LoRA adapter per model. Counting the samples on its ``/metrics`` gives the
   fixed cost, the cost per model and the cost per adapter. The vLLM page's own series per
   model are counted from the capture the same way, since Prometheus scrapes vLLM too, and the
   recording rules add a fixed number of series per pod and model.

2. **Rule evaluation at fleet size** (a real Prometheus; run it under the e2e lock). A
   loopback exporter serves the series the rules read, for ``--pods`` pods x ``--models``
   models, labelled with ``namespace`` and ``pod`` and scraped with ``honor_labels`` as one
   target, so one Prometheus holds the whole fleet. Every series comes from the real pages of
   part 1 (names, label sets, histogram buckets), only relabelled per pod and model; counters
   grow at a steady rate with a per-pod factor, so every rate() and ratio is a real number.
   The committed recording and alert rules (``alerts/*.yaml``) are evaluated every
   ``--interval``; after the 5m rate windows hold at least two scrapes, Prometheus' own
   ``prometheus_rule_group_last_duration_seconds`` is read at every evaluation, along with its
   head series. Series that no rule reads do not change what the rules compute; ``--full``
   serves every series of both pages instead, to show what they cost in memory and in
   evaluation time (an index with more series).

Run from the repository root::

    .venv/bin/python -m bench.scrape.scale --series-only            # part 1, seconds
    flock /tmp/kvtax-e2e.lock .venv/bin/python -m bench.scrape.scale --pods 1000 --models 4

It prints Markdown tables; docs/scale.md holds a run's results.
"""

from __future__ import annotations

import argparse
import http.server
import json
import math
import re
import statistics
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import requests
from prometheus_client.exposition import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from bench import record
from bench.scrape.pipeline import multi_model_payload
from kvtax.delivery.ledger import ITL_BUCKETS, HistogramAccumulator, RequestRecord
from kvtax.mixin.rules import DEFAULT, fleet, per_pod, recording_rules
from kvtax.mixin.rules.alerts import alert_rules
from kvtax.serve.config import load_config
from kvtax.serve.wiring import build
from kvtax_dev.exposition import Samples, read_samples
from kvtax_dev.promapi import PrometheusApi
from kvtax_dev.promql import series_names
from kvtax_dev.testbed.engine import free_port
from kvtax_dev.testbed.promstack import PrometheusProcess

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "vllm"
# A real 0.32 page with kvtax's plugin loaded and a LoRA adapter served (every series a pod with
# the plugin shows), and the same engine's page at start, to give counters an increase.
CAPTURE = FIXTURES / "0.32-lora.prom"
IDLE = FIXTURES / "0.32-idle.prom"
RULE_FILES = (ROOT / "alerts" / "kvtax-recording.yaml", ROOT / "alerts" / "kvtax-alerts.yaml")
NAMESPACE = "serving"
# Prometheus adds up, scrape_duration_seconds, scrape_samples_scraped,
# scrape_samples_post_metric_relabeling and scrape_series_added to every target; a pod has two
# targets (vLLM and kvtax).
TARGET_SERIES = 5
TARGETS_PER_POD = 2
_MODEL_LABEL = re.compile(r'model_name="[^"]*"')


# -- part 1: series one sidecar exports ---------------------------------------------------------


def _model(i: int) -> str:
    return f"team-{i:02d}/Llama-3.1-8B-Instruct"


def _samples(text: str) -> list[tuple[str, dict[str, str]]]:
    # _created samples included: Prometheus stores them as series of their own when it reads
    # the classic text format (vLLM's page has them; kvtax's has none).
    return [
        (s.name, dict(s.labels))
        for family in text_string_to_metric_families(text)
        for s in family.samples
    ]


def kvtax_page(models: int, adapters_per_model: int) -> str:
    """kvtax's /metrics after two scrapes of ``models`` models and one request per model and
    per adapter (a completed one, with a TTFT, gaps and a stall, so every family shows)."""
    config = load_config(
        {
            "proxy.listen_address": "off",
            "window": "60s",
            "delivery.models_refresh": "0",
            "max_num_seqs": "64",  # publishes the configured value and the over-admission ratio
        },
        env={},
        file=None,
    )
    stack = build(config)
    idle = multi_model_payload(IDLE.read_text(), models)
    vllm = multi_model_payload(CAPTURE.read_text(), models)
    stack.names.set_adapters(
        {
            f"{_model(m)}-lora-{a}": _model(m)
            for m in range(models)
            for a in range(adapters_per_model)
        }
    )
    stack.scrape.ingest(idle, timestamp=1000.0)
    for name in [_model(m) for m in range(models)] + list(stack.names.adapters):
        stack.ledger.settle(
            RequestRecord(
                name,
                "completed",
                delivered_tokens=10,
                prompt_tokens=5,
                duration=1.0,
                ttft=0.1,
                itl=HistogramAccumulator.of(ITL_BUCKETS, (0.01,)),
                stalls=((0.5, 12),),
                slo_met=True,
            )
        )
    stack.scrape.ingest(vllm, timestamp=1005.0)
    return generate_latest(stack.web.registry).decode()


@dataclass(frozen=True, slots=True)
class SeriesCounts:
    kvtax_fixed: int
    kvtax_per_model: int
    kvtax_per_adapter: int
    vllm_fixed: int
    vllm_per_model: int
    records_per_pod_model: int
    records_per_model: int
    vllm_read_per_model: int  # of vllm_per_model, those a rule or a dashboard panel reads

    def per_pod(self, models: int, adapters: int = 0) -> int:
        """Series Prometheus holds for one pod: both pages plus the per-pod records."""
        return (
            TARGET_SERIES * TARGETS_PER_POD
            + self.kvtax_fixed
            + self.vllm_fixed
            + models * (self.kvtax_per_model + self.vllm_per_model + self.records_per_pod_model)
            + adapters * self.kvtax_per_adapter
        )


def count_series() -> SeriesCounts:
    kvtax = {(m, a): len(_samples(kvtax_page(m, a))) for m, a in ((1, 0), (2, 0), (1, 1), (4, 0))}
    per_model = kvtax[(2, 0)] - kvtax[(1, 0)]
    # Linear in models: 4 models cost 3 more than 1.
    assert kvtax[(4, 0)] - kvtax[(1, 0)] == 3 * per_model, kvtax
    vllm_one = len(_samples(multi_model_payload(CAPTURE.read_text(), 1)))
    vllm_two = len(_samples(multi_model_payload(CAPTURE.read_text(), 2)))
    records = recording_rules(DEFAULT)
    pod_level = sum(1 for r in records if r.record.startswith(per_pod("", "").split(":")[0]))
    return SeriesCounts(
        kvtax_fixed=kvtax[(1, 0)] - per_model,
        kvtax_per_model=per_model,
        kvtax_per_adapter=kvtax[(1, 1)] - kvtax[(1, 0)],
        vllm_fixed=vllm_one - (vllm_two - vllm_one),
        vllm_per_model=vllm_two - vllm_one,
        records_per_pod_model=pod_level,
        records_per_model=len(records) - pod_level,
        vllm_read_per_model=sum(
            1
            for name, labels in _samples(multi_model_payload(CAPTURE.read_text(), 1))
            if "model_name" in labels and name.startswith("vllm:") and name in read_series()
        ),
    )


def read_series() -> set[str]:
    """Every series name a rule or a dashboard panel reads."""
    from kvtax.mixin.dashboards.generate import dashboards
    from kvtax_dev.dashboard_lint import queries

    names = rule_series()
    for board in dashboards().values():
        for _, target in queries(board):
            names |= series_names(target["expr"])
    return names


# -- part 2: a synthetic fleet in a real Prometheus ---------------------------------------------


def rule_series() -> set[str]:
    """Every series name the committed recording and alert rules read (records excluded)."""
    exprs = [r.expr for r in recording_rules(DEFAULT)] + [r.expr for r in alert_rules(DEFAULT)]
    names: set[str] = set()
    for expr in exprs:
        names |= series_names(expr)
    return names - {r.record for r in recording_rules(DEFAULT)}


@dataclass(frozen=True, slots=True)
class Template:
    """One series of one pod's pages, with ``{pod}`` and ``{model}`` still to fill."""

    head: str  # name{labels without the closing brace
    value: float
    counter: bool
    per_model: bool  # has a model_name; else once per pod


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))


def templates(full: bool) -> list[Template]:
    """One model's series of both pages (vLLM's and kvtax's), as templates."""
    wanted = rule_series()
    out: list[Template] = []
    pages = (CAPTURE.read_text(), kvtax_page(1, 0))
    for page in pages:
        for family in text_string_to_metric_families(page):
            counter = family.type in ("counter", "histogram", "summary")
            for s in family.samples:
                if not full and s.name not in wanted and family.name not in wanted:
                    continue
                labels = {k: v for k, v in s.labels.items() if k != "model_name"}
                if "model_name" in s.labels:
                    labels["model_name"] = "{model}"
                head = f"{s.name}{{{_labels(labels)}"
                rate = counter and not s.name.endswith(("_info", "_created"))
                out.append(Template(head, float(s.value), rate, "model_name" in s.labels))
    return out


class FleetPage:
    """The whole fleet as one page; counters grow with time at a per-pod pace."""

    def __init__(self, templates: list[Template], pods: int, models: int) -> None:
        self.start = time.time()
        self.rows: list[tuple[str, float, float]] = []  # (prefix, value, rate per second)
        for p in range(pods):
            pace = 1.0 + (p % 7) / 7  # pods are not all alike
            pod = f'namespace="{NAMESPACE}",pod="vllm-{p:04d}"'
            for m in range(models):
                for t in templates:
                    if m > 0 and not t.per_model:
                        continue  # a pod-wide series appears once per pod
                    head = t.head.replace("{model}", _model(m))
                    sep = "," if not head.endswith("{") else ""
                    prefix = f"{head}{sep}{pod}}} "
                    rate = max(t.value, 1.0) / 600.0 * pace if t.counter else 0.0
                    self.rows.append((prefix, t.value, rate))

    @property
    def series(self) -> int:
        return len(self.rows)

    def render(self) -> bytes:
        elapsed = time.time() - self.start
        return "".join(f"{p}{v + r * elapsed:.3f}\n" for p, v, r in self.rows).encode()


@contextmanager
def serve(page: FleetPage) -> Iterator[str]:
    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            body = page.render()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    port = free_port()
    server = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        server.shutdown()
        server.server_close()


def prometheus_yaml(target: str, interval: str) -> str:
    job = {
        "job_name": "kvtax",
        "honor_labels": True,
        "scrape_interval": interval,
        "scrape_timeout": interval,
        "static_configs": [{"targets": [target]}],
    }
    glob = {"scrape_interval": interval, "evaluation_interval": interval}
    return f"global: {json.dumps(glob)}\nscrape_configs: {json.dumps([job])}\n"


@dataclass(frozen=True, slots=True)
class FleetResult:
    pods: int
    models: int
    full: bool
    served_series: int
    head_series: float
    groups: dict[str, list[float]]  # rule group -> evaluation durations, seconds
    queries: dict[str, float]  # Fleet panel -> query seconds (median of 3)
    scrape_seconds: list[float]


def _own_metrics(url: str) -> Samples:
    """Prometheus' own /metrics (it does not scrape itself here)."""
    return read_samples(requests.get(f"{url}/metrics", timeout=30).text)


def _watch_groups(url: str, seconds: float, poll: float) -> tuple[dict[str, list[float]], float]:
    """Each rule group's evaluation durations over ``seconds``, one per evaluation (told apart
    by its timestamp), and the head series at the end."""
    seen: dict[tuple[str, float], float] = {}
    head = math.nan
    deadline = time.monotonic() + seconds
    while True:
        page = _own_metrics(url)
        stamps = page.get("prometheus_rule_group_last_evaluation_timestamp_seconds", {})
        durations = page.get("prometheus_rule_group_last_duration_seconds", {})
        for labels, duration in durations.items():
            group = dict(labels)["rule_group"].rpartition(";")[2]
            stamp = stamps.get(labels, math.nan)
            if stamp > 0:
                seen[(group, stamp)] = duration
        head = next(iter(page.get("prometheus_tsdb_head_series", {}).values()), math.nan)
        if time.monotonic() >= deadline:
            break
        time.sleep(poll)
    groups: dict[str, list[float]] = {}
    for (group, _), duration in sorted(seen.items()):
        groups.setdefault(group, []).append(duration)
    return groups, head


def _query_seconds(api: PrometheusApi, expr: str) -> float:
    times = []
    for _ in range(3):
        began = time.perf_counter()
        api.query(expr)
        times.append(time.perf_counter() - began)
    return statistics.median(times)


def fleet_queries() -> dict[str, str]:
    """The Fleet dashboard's heaviest per-pod and fleet queries, and the same from raw series."""
    tax, work = (
        per_pod("kvtax_preemption_tax", "ratio_rate5m"),
        fleet("kvtax_preemption_tax", "ratio_rate5m"),
    )
    raw = next(r.expr for r in recording_rules(DEFAULT) if r.record == tax)
    return {
        "top 5 pods by tax (record)": f"topk(5, max by (namespace, pod, model_name) ({tax}))",
        "fleet tax per model (record)": f"max by (model_name) ({work})",
        "per-pod recompute from raw counters (what the record saves)": raw,
    }


def measure_fleet(
    pods: int, models: int, full: bool, interval: float, evaluations: int
) -> FleetResult:
    page = FleetPage(templates(full), pods, models)
    print(f"serving {page.series:,} series ({pods} pods x {models} models)", file=sys.stderr)
    with serve(page) as target:
        config = prometheus_yaml(target, f"{interval:g}s")
        with PrometheusProcess(config, list(RULE_FILES)) as prom:
            api = PrometheusApi(prom.url, timeout=60.0)
            prom.wait_for(
                lambda: prom.query('up{job="kvtax"} == 1'), timeout=300, what="first scrape"
            )
            # Two scrapes before rate() has a value, then the evaluations measured.
            time.sleep(2 * interval)
            start = time.time()
            groups, head = _watch_groups(prom.url, evaluations * interval, interval / 3)
            end = time.time()
            scrapes = api.query_range(
                'scrape_duration_seconds{job="kvtax"}', start, end, interval / 2
            )
            scrape_seconds = sorted({v for s in scrapes for _, v in s.points})
            queries = {name: _query_seconds(api, q) for name, q in fleet_queries().items()}
    return FleetResult(pods, models, full, page.series, head, groups, queries, scrape_seconds)


# -- report ------------------------------------------------------------------------------------


def _series_table(c: SeriesCounts) -> str:
    rows = [
        ("kvtax /metrics, fixed (process, scrape health, proxy)", c.kvtax_fixed),
        ("kvtax /metrics, per model", c.kvtax_per_model),
        ("kvtax /metrics, per LoRA adapter", c.kvtax_per_adapter),
        ("vLLM /metrics (0.32), fixed", c.vllm_fixed),
        ("vLLM /metrics (0.32), per model", c.vllm_per_model),
        ("... of which a rule or a dashboard reads", c.vllm_read_per_model),
        ("recording rules, per pod and model", c.records_per_pod_model),
        (
            "Prometheus' own per target (up, scrape_*), two targets a pod",
            TARGET_SERIES * TARGETS_PER_POD,
        ),
        ("recording rules, per model (fleet)", c.records_per_model),
    ]
    return record.table(["what", "series"], [[what, f"{n:,}"] for what, n in rows], "lr")


def _fleet_table(r: FleetResult) -> str:
    groups = [
        [name, str(len(v)), f"{statistics.median(v) * 1000:.0f} ms", f"{max(v) * 1000:.0f} ms"]
        for name, v in sorted(r.groups.items())
        if v
    ]
    lines = [
        f"{r.pods} pods x {r.models} models, "
        f"{'every series' if r.full else 'the series the rules read'}: "
        f"{r.served_series:,} series served, {r.head_series:,.0f} in Prometheus' head "
        f"(records and Prometheus' own included)",
        "",
        record.table(["rule group", "evaluations", "median", "max"], groups, "lrrr"),
    ]
    if r.scrape_seconds:
        lines.append("")
        lines.append(
            f"scrape of the whole fleet page: median {statistics.median(r.scrape_seconds):.2f} s, "
            f"max {max(r.scrape_seconds):.2f} s"
        )
    queries = [[name, f"{s:.3f}"] for name, s in r.queries.items()]
    lines += ["", record.table(["query", "seconds (median of 3)"], queries, "lr")]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="bench.scrape.scale", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--pods", type=int, default=1000, help="synthetic pods (default 1000)")
    parser.add_argument("--models", type=int, default=4, help="models per pod (default 4)")
    parser.add_argument(
        "--interval", type=float, default=30.0, help="scrape and evaluation interval, s (30)"
    )
    parser.add_argument(
        "--evaluations", type=int, default=8, help="rule evaluations to measure (default 8)"
    )
    parser.add_argument(
        "--full", action="store_true", help="serve every series, not only those the rules read"
    )
    parser.add_argument("--series-only", action="store_true", help="part 1 only (no servers)")
    args = parser.parse_args(argv)
    counts = count_series()
    print("## Series one sidecar's pod adds to Prometheus\n")
    print(_series_table(counts))
    for models, adapters in ((1, 0), (4, 0), (4, 8)):
        per = counts.per_pod(models, adapters)
        print(
            f"\none pod, {models} model(s), {adapters} adapter(s): {per:,} series; "
            f"x 1,000 pods = {per * 1000:,} (+ {counts.records_per_model * models} fleet records)"
        )
    if args.series_only:
        return 0
    result = measure_fleet(args.pods, args.models, args.full, args.interval, args.evaluations)
    print("\n## Rule evaluation\n")
    print(_fleet_table(result))
    return 0 if all(result.groups.values()) and not math.isnan(result.head_series) else 1


if __name__ == "__main__":
    raise SystemExit(main())
