"""Every dashboard query against a real Prometheus holding a real overload, and the PNG preview.

A real ``kvtax serve`` (with its proxy) watches the session's real vLLM CPU engine; a real
Prometheus scrapes both every 3 s and evaluates the committed recording rules
(``alerts/kvtax-recording.yaml``). The load is the known overload (64 concurrent streams x 300
tokens against a 2,048-token pool, eight times what it holds), once, sent through the proxy,
with a few clients that hang up early. Then every target of every panel, with the template variables
filled in as Grafana would, must parse and return at least one series with a number in it,
and ``kvtax dashboards preview`` must draw each dashboard from that Prometheus.

Set ``KVTAX_SAVE_PREVIEW=DIR`` to keep the PNGs and their ``.panels.json`` records (the README's
picture, docs/img/kvtax-overview.png, comes from ``scripts/demo --with-prometheus`` instead).
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from kvtax.cli.main import main
from kvtax.mixin.dashboards import dashboards
from kvtax.mixin.dashboards.queries import expand
from kvtax.mixin.rules.recording import RECOMPUTE_COUNTERS
from kvtax.serve.config import parse_duration
from kvtax_dev import repo_root
from kvtax_dev.dashboard_lint import queries
from kvtax_dev.preview import panel_titles, record_path
from kvtax_dev.promapi import PrometheusApi
from kvtax_dev.promql import series_names
from kvtax_dev.testbed import VllmEngine
from kvtax_dev.testbed.load import drive
from kvtax_dev.testbed.promstack import PrometheusProcess, prometheus_config
from kvtax_dev.testbed.sidecar import KvtaxProcess

pytestmark = pytest.mark.e2e

RECORDING_RULES = repo_root() / "alerts" / "kvtax-recording.yaml"
# Two cores run vLLM, the proxy, kvtax and Prometheus at once: at 1 s many scrapes time out
# mid-overload and leave holes; 3 s holds.
SCRAPE_INTERVAL = "3s"
# Well above 4 x the scrape interval, as Grafana's $__rate_interval would be, and long enough
# to span the whole overload.
RATE_INTERVAL = "1m"
ROUNDS = 1
# Tokens per request: enough that every panel has preemptions, recompute and waste to show.
MAX_TOKENS = 300
# The query's recording rule that settles last (it reads other records).
LAST_RECORD = "model_name:kvtax_waste:ratio_rate5m"


@dataclass(frozen=True, slots=True)
class Overload:
    api: PrometheusApi
    url: str
    model: str
    start: float
    end: float


async def _overload(url: str, model: str, rounds: int) -> None:
    for _ in range(rounds):
        await asyncio.gather(
            drive(url, model, concurrency=64, max_tokens=MAX_TOKENS, stream=True),
            # Clients that leave mid-stream: their tokens are generated but never delivered.
            drive(
                url,
                model,
                concurrency=6,
                max_tokens=MAX_TOKENS,
                stream=True,
                disconnect_after_chunks=3,
            ),
        )


@pytest.fixture(scope="module")
def overload(vllm_engine: VllmEngine) -> Iterator[Overload]:
    with KvtaxProcess(
        vllm_engine.url,
        proxy=True,
        scrape_interval="1s",
        window="60s",
        extra_args=[f"--max-num-seqs={vllm_engine.max_num_seqs}"],
    ) as kvtax:
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape")
        assert kvtax.proxy_url is not None
        jobs = {
            "kvtax": [kvtax.base_url.removeprefix("http://")],
            "vllm": [vllm_engine.url.removeprefix("http://")],
        }
        config = prometheus_config(jobs, interval=SCRAPE_INTERVAL)
        with PrometheusProcess(config, rule_files=[RECORDING_RULES]) as prometheus:
            prometheus.wait_for(
                lambda: len(prometheus.query("up == 1")) == len(jobs), what="both targets up"
            )
            # One small request first, so the delivery counters exist before the overload
            # and rate() sees their whole increase.
            asyncio.run(
                drive(
                    kvtax.proxy_url,
                    vllm_engine.model_name,
                    concurrency=1,
                    max_tokens=8,
                    stream=True,
                )
            )
            prometheus.wait_for(
                lambda: prometheus.query("kvtax_delivered_tokens_total"), what="delivery counters"
            )
            start = time.time()
            asyncio.run(_overload(kvtax.proxy_url, vllm_engine.model_name, ROUNDS))
            # kvtax's window figures (tax, waste, coverage) land a scrape or two later, and
            # Prometheus needs a scrape and a rule evaluation after that.
            kvtax.wait_for(
                lambda m: any(k.startswith("kvtax_waste_ratio{") for k in m),
                what="the waste ratio",
            )
            prometheus.wait_for(lambda: prometheus.query(LAST_RECORD), what=LAST_RECORD)
            # Both targets scraped twice more, so each rate's last sample is after the load.
            since = time.time() + parse_duration(SCRAPE_INTERVAL)
            prometheus.wait_for(
                lambda: prometheus.query(f"min(timestamp(up)) > {since}"),
                what="two more scrapes of each target",
            )
            api = PrometheusApi(prometheus.url)
            yield Overload(api, prometheus.url, vllm_engine.model_name, start, time.time())


def _absent_method(overload: Overload, expr: str) -> bool:
    """True when ``expr`` reads the measured or stall-based recompute counter and Prometheus holds
    none of it. The estimate needs only vLLM's own metrics, so it is never excused."""
    counters = series_names(expr) & set(RECOMPUTE_COUNTERS.values())
    if len(counters) != 1 or counters == {RECOMPUTE_COUNTERS["estimated"]}:
        return False
    return not overload.api.query(counters.pop(), overload.end)


# Published with the gate off too (the advice for vLLM's own caps); every other gate series
# exists only while the proxy's gate is on, and this run leaves it off.
_GATE_ADVICE = "kvtax_gate_advised_cap"


def _gate_off(overload: Overload, expr: str) -> bool:
    """True when ``expr`` reads only the gate's own series and Prometheus holds none
    of them: the gate is opt-in, and the overload here runs without it (tests/e2e/test_gate_e2e.py
    drives it). The advice is published either way, so a query of it is never excused."""
    gate = {n for n in series_names(expr) if n.startswith("kvtax_gate_")}
    if not gate or _GATE_ADVICE in gate:
        return False
    return not any(overload.api.query(name, overload.end) for name in gate)


# The Overview's recompute-avoided row: its KV connector lines exist only where vLLM runs with a
# connector, and the session engine runs without one; tests/e2e/test_offload_e2e.py checks that
# row with data on an engine with LMCache.
_LOADED = 'kvtax_recompute_avoided_tokens_total{source="kv_connector"}'


def _no_connector(overload: Overload, expr: str) -> bool:
    """True when ``expr`` reads the tokens a KV connector loaded and Prometheus holds none."""
    reads = "kvtax_recompute_avoided_tokens_total" in series_names(expr)
    loaded = 'source="kv_connector"' in expr
    return reads and loaded and not overload.api.query(_LOADED, overload.end)


# An estimate is drawn only where no measurement exists (the Overview's Tax by method): with
# the session engine's plugin measuring, the whole query is rightly empty, and its left side is
# what must have data.
_UNLESS = " unless on (model_name) "


def _cases() -> list[tuple[str, str, str, str]]:
    return [
        (doc["uid"], panel["title"], target["refId"], target["expr"])
        for doc in dashboards().values()
        for panel, target in queries(doc)
    ]


@pytest.mark.parametrize(
    ("uid", "title", "ref", "expr"),
    _cases(),
    ids=[f"{c[0]}:{c[1]}:{c[2]}" for c in _cases()],
)
def test_every_panel_query_returns_data(
    overload: Overload, uid: str, title: str, ref: str, expr: str
) -> None:
    for values in ({}, {"model_name": overload.model}):
        filled = expand(expr, rate_interval=RATE_INTERVAL, values=values)
        series = overload.api.query(filled, overload.end)
        if _UNLESS in filled:
            shown, hidden_by = filled.split(_UNLESS)
            masked = overload.api.query(hidden_by, overload.end)
            assert not (series and masked), f"{uid} / {title} / {ref}: drawn beside its mask"
            if masked:
                # Hidden where the measurement is: what it would draw must still exist.
                series = overload.api.query(shown, overload.end)
                expr = shown
        if not series and _no_connector(overload, expr):
            continue
        if not series and _absent_method(overload, expr):
            # A method's line is absent exactly when kvtax publishes no counter for it.
            continue
        if not series and _gate_off(overload, expr):
            continue
        assert series, f"{uid} / {title} / {ref}: no series for\n{filled}"
        # A series of NaN (a quantile of empty buckets) would prove nothing.
        numbers = [v for s in series for _, v in s.points]
        assert any(math.isfinite(v) for v in numbers), (uid, title, ref, numbers)


def test_preview_draws_every_dashboard(
    overload: Overload, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = main(
        [
            "dashboards",
            "preview",
            "--prometheus",
            overload.url,
            "--out",
            str(tmp_path),
            "--from",
            str(overload.start - 20),
            "--to",
            str(overload.end),
            "--scrape-interval",
            SCRAPE_INTERVAL,
            "--var",
            f"model_name={overload.model}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0
    pngs = sorted(tmp_path.glob("*.png"))
    assert [p.name for p in pngs] == ["kvtax-capacity.png", "kvtax-fleet.png", "kvtax-overview.png"]
    for png in pngs:
        data = png.read_bytes()
        assert data.startswith(b"\x89PNG\r\n\x1a\n")
        # A drawn dashboard, not an empty canvas.
        assert len(data) > 30_000, (png.name, len(data))
    assert out.count(": 0 query errors") == 3, out
    current = {doc["uid"]: doc for doc in dashboards().values()}
    for png in pngs:
        record = json.loads(record_path(png).read_text())
        assert record["panels"] == panel_titles(current[png.stem]), png.name
    save = os.environ.get("KVTAX_SAVE_PREVIEW")
    if save:
        for png in pngs:
            shutil.copy(png, Path(save) / png.name)
            shutil.copy(record_path(png), Path(save) / record_path(png).name)
