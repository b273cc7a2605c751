"""``kvtax demo``: the preemption tax, live, on a real vLLM CPU engine in about two minutes.

The demo installs the engine's own virtual environment (once per machine), makes a tiny local
model, starts a real vLLM 0.32 CPU engine with a small KV pool and kvtax's stat-logger plugin,
and a real ``kvtax serve`` with its proxy in front. It then drives a load that overflows the KV
pool and one that fits, through the proxy, while a live view shows what kvtax publishes. The
summary compares the two phases from kvtax's own counters. Every process it starts is stopped on
exit, Ctrl-C included.

The figures here are the ones any Prometheus would scrape from kvtax; the phase figures and the
lines printed are pure and tested, in :mod:`kvtax_dev.demo_view`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.parse
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtax_dev import dev_env
from kvtax_dev.demo_view import (
    PhaseResult,
    phase_result,
    render_empty_panels,
    render_status,
    render_summary,
    window_holds,
)
from kvtax_dev.testbed.engine import VllmEngine
from kvtax_dev.testbed.load import drive
from kvtax_dev.testbed.promstack import AlertmanagerProcess, PrometheusProcess, prometheus_config
from kvtax_dev.testbed.sidecar import KvtaxProcess
from kvtax_dev.testbed.webhook import WebhookReceiver

__all__ = ["PHASES", "Phase", "run_demo"]


@dataclass(frozen=True, slots=True)
class Phase:
    name: str
    concurrency: int
    requests: int
    max_tokens: int


# 64 long generations at once need ~64 x 541 tokens of KV against a 2,048-token pool: the
# engine must preempt. Four at a time fit.
PHASES = (Phase("overload", 64, 64, 500), Phase("calm", 4, 8, 200))
SHORT_PHASES = (Phase("overload", 32, 32, 300), Phase("calm", 2, 4, 100))
CONFIGURED_MAX_NUM_SEQS = 64
# kvtax's sliding window: its thrash state and sizing in the live view cover this span.
WINDOW_S = 20
# Prometheus' scrape interval, and so its timeout: vLLM's /metrics answers in over a second
# while the overload holds both cores, and a 1 s scrape then loses the overload's samples.
SCRAPE_INTERVAL = "2s"
# The pages an overload must raise: the engine's preemptions, and the error budget it burns
# (every request of the overload misses the objective). The demo waits for both.
EXPECTED_ALERTS = frozenset({"KvtaxVllmPreempting", "KvtaxErrorBudgetBurn"})


class _Live:
    """Redraws the status block in place on a terminal; prints every few seconds otherwise."""

    def __init__(self) -> None:
        self.tty = sys.stdout.isatty()
        self.drawn = 0
        self.last_print = 0.0

    def show(self, lines: list[str]) -> None:
        if self.tty:
            if self.drawn:
                sys.stdout.write(f"\x1b[{self.drawn}F\x1b[J")
            sys.stdout.write("\n".join(lines) + "\n")
            sys.stdout.flush()
            self.drawn = len(lines)
        elif time.monotonic() - self.last_print >= 5:
            print("\n".join(lines), flush=True)
            self.last_print = time.monotonic()

    def release(self) -> None:
        self.drawn = 0


def _progress(message: str) -> None:
    print(f"kvtax demo: {message}", file=sys.stderr, flush=True)


@dataclass
class _Stack:
    engine: VllmEngine
    kvtax: KvtaxProcess
    prometheus: PrometheusProcess | None = None
    webhook: WebhookReceiver | None = None
    workdir: Path = field(default_factory=Path)


def _address(url: str) -> str:
    return urllib.parse.urlsplit(url).netloc


@contextlib.contextmanager
def _stack(args: argparse.Namespace) -> Iterator[_Stack]:
    _progress("preparing the vLLM CPU engine (the first run installs it: a few minutes)")
    with contextlib.ExitStack() as stack:
        workdir = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="kvtax-demo-")))
        engine = VllmEngine(max_num_seqs=CONFIGURED_MAX_NUM_SEQS)
        # kvtax first, watching a vLLM that is not up yet, as in a pod whose containers start
        # together: a Ctrl-C during the engine's long start then finds both to stop.
        kvtax = stack.enter_context(
            KvtaxProcess(
                engine.url,
                proxy=True,
                window=f"{WINDOW_S}s",
                extra_args=[f"--max-num-seqs={CONFIGURED_MAX_NUM_SEQS}"],
                log_path=workdir / "kvtax.log",
            )
        )
        _progress(f"kvtax is up: metrics {kvtax.metrics_url}, proxy {kvtax.proxy_url}")
        stack.enter_context(engine)
        _progress(f"vLLM is up at {engine.url} with a {engine.kv_capacity_tokens:,}-token KV pool")
        kvtax.wait_for(lambda m: m.get("kvtax_vllm_up") == 1.0, what="first scrape of vLLM")
        running = _Stack(engine, kvtax, workdir=workdir)
        if args.with_prometheus:
            _start_monitoring(stack, running)
        yield running


def _start_monitoring(stack: contextlib.ExitStack, running: _Stack) -> None:
    """Prometheus with kvtax's rules (short test profile) and Alertmanager with the example
    routing, its receivers pointed at a local webhook so the page can be shown."""
    import yaml

    from kvtax.mixin.rules import TEST_PROFILE
    from kvtax.mixin.rules.alertmanager import alertmanager_config
    from kvtax.mixin.rules.configfile import document_of
    from kvtax.mixin.rules.render import alerts_yaml, dump, recording_yaml

    rules = [running.workdir / "kvtax-recording.yaml", running.workdir / "kvtax-alerts.yaml"]
    rules[0].write_text(recording_yaml(TEST_PROFILE))
    rules[1].write_text(alerts_yaml(TEST_PROFILE))
    # The same settings build the dashboards the previews draw: they read the windows this
    # Prometheus records, and agree with the alerts it sends.
    rules_config(running.workdir).write_text(yaml.safe_dump(document_of(TEST_PROFILE)))
    hook = stack.enter_context(WebhookReceiver())
    am_config = alertmanager_config(
        pager_url=hook.url + "/pager",
        ticket_url=hook.url + "/ticket",
        group_wait="1s",
        group_interval="1s",
        repeat_interval="1h",
    )
    am = stack.enter_context(
        AlertmanagerProcess(dump(am_config), log_path=running.workdir / "alertmanager.log")
    )
    config = prometheus_config(
        {"vllm": [_address(running.engine.url)], "kvtax": [_address(running.kvtax.base_url)]},
        interval=SCRAPE_INTERVAL,
        alertmanager_url=am.url,
    )
    prom = stack.enter_context(
        PrometheusProcess(config, rules, log_path=running.workdir / "prometheus.log")
    )
    prom.wait_for(lambda: bool(prom.query("kvtax_vllm_up == 1")), what="kvtax scraped")
    _progress(f"Prometheus at {prom.url}, Alertmanager at {am.url} (rules: short test profile)")
    running.prometheus, running.webhook = prom, hook


def _pages(hook: WebhookReceiver) -> list[tuple[str, dict[str, Any]]]:
    return [(path, alert) for path, alert in hook.alerts() if alert.get("status") == "firing"]


def _show_alerts(running: _Stack, timeout: float = 60.0) -> list[str]:
    """Wait for the expected alerts to reach the webhook, then describe what arrived."""
    assert running.webhook is not None
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        pages = _pages(running.webhook)
        if {a["labels"].get("alertname") for _, a in pages} >= EXPECTED_ALERTS:
            break
        time.sleep(1.0)
    lines = []
    seen = set()
    for path, alert in _pages(running.webhook):
        labels = alert["labels"]
        key = (labels.get("alertname"), path)
        if key in seen:
            continue
        seen.add(key)
        lines.append(
            f"  {labels.get('alertname')} [{labels.get('severity')}] -> {path.strip('/')}: "
            f"{alert['annotations'].get('description', '')}"
        )
        lines.append(f"      runbook: {alert['annotations'].get('runbook_url', '-')}")
    if not lines:
        lines.append(f"  (no alert reached Alertmanager's receivers within {timeout:.0f}s)")
    return lines


def rules_config(workdir: Path) -> Path:
    """Where the demo writes the rules settings its Prometheus and its previews share."""
    return workdir / "kvtax-rules-config.yaml"


def _previews(running: _Stack, since: float, out: Path) -> Path | None:
    """Render the dashboards from the demo's Prometheus with ``kvtax dashboards preview``."""
    assert running.prometheus is not None
    span = max(30, int(time.time() - since) + 5)
    cmd = [
        sys.executable, "-m", "kvtax.cli.main", "dashboards", "preview",
        "--prometheus", running.prometheus.url, "--out", str(out),
        "--range", f"{span}s", "--scrape-interval", SCRAPE_INTERVAL,
        "--config", str(rules_config(running.workdir)),
    ]  # fmt: skip
    # The child must import kvtax_dev too, and sys.path edits do not reach it.
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, env=dev_env(os.environ))
    if done.returncode != 0:
        _progress(f"dashboard previews failed: {done.stderr.strip()[-400:]}")
        return None
    return out


def _scraped_twice_more(kvtax: KvtaxProcess) -> dict[str, float]:
    """kvtax's /metrics once it has scraped vLLM twice more than when called."""
    first = kvtax.metrics().get("kvtax_scrapes_total", 0.0)
    return kvtax.wait_for(
        lambda m: m.get("kvtax_scrapes_total", 0.0) >= first + 2, what="two more scrapes"
    )


async def _run_phase(
    kvtax: KvtaxProcess,
    engine: VllmEngine,
    phase: Phase,
    live: _Live,
    previous: tuple[str, float] | None,
) -> tuple[PhaseResult, dict[str, float]]:
    """Drive one phase with the live view; ``previous`` is the earlier phase's name and the
    monotonic time its closing counters were read, so the view knows what kvtax's window holds."""
    assert kvtax.proxy_url is not None
    before = await asyncio.to_thread(kvtax.metrics)
    started = time.monotonic()

    def status(now: dict[str, float], elapsed: float) -> list[str]:
        holds = (
            window_holds(previous[0], time.monotonic() - previous[1], WINDOW_S)
            if previous is not None
            else None
        )
        return render_status(phase.name, elapsed, before, now, window_s=WINDOW_S, holds=holds)

    load = asyncio.create_task(
        drive(
            kvtax.proxy_url,
            engine.model_name,
            concurrency=phase.concurrency,
            requests=phase.requests,
            max_tokens=phase.max_tokens,
            stream=True,
        )
    )
    while not load.done():
        with contextlib.suppress(OSError):  # a missed frame is fine; the next poll catches up
            metrics = await asyncio.to_thread(kvtax.metrics)
            live.show(status(metrics, time.monotonic() - started))
        await asyncio.wait({load}, timeout=1.0)
    await load
    seconds = time.monotonic() - started
    # vLLM counts a preemption when the request next produces output: let two of kvtax's
    # scrapes land after the load before reading the phase's counters.
    after = await asyncio.to_thread(_scraped_twice_more, kvtax)
    live.show(status(after, seconds))
    live.release()
    return phase_result(phase.name, seconds, before, after), after


def _interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def _stop_on_signals() -> None:
    """Ctrl-C and ``kill`` both end the demo through the ``with`` block that stops its engine,
    kvtax and Prometheus. Without this, a demo started in a script's background ignores Ctrl-C
    (bash hands background jobs an ignored SIGINT, and Python then installs no handler), and
    SIGTERM ends Python without any cleanup: either way the engine, in a process group of its
    own, kept serving."""
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _interrupt)


def run_demo(args: argparse.Namespace) -> int:
    _stop_on_signals()
    phases = SHORT_PHASES if args.short else PHASES
    live = _Live()
    alert_lines: list[str] = []
    previews: Path | None = None
    try:
        with _stack(args) as running:
            # The previews start a little before the load: the engine's start is not news.
            began = time.time() - 10
            results = []
            last: dict[str, float] = {}
            previous: tuple[str, float] | None = None
            for phase in phases:
                _progress(
                    f"phase {phase.name}: {phase.requests} streams, {phase.concurrency} at "
                    f"a time, {phase.max_tokens} tokens each"
                )
                result, last = asyncio.run(
                    _run_phase(running.kvtax, running.engine, phase, live, previous)
                )
                results.append(result)
                previous = (phase.name, time.monotonic())
            metrics_url = running.kvtax.metrics_url
            if running.prometheus is not None:
                _progress("waiting for the preemption and burn-rate pages to reach Alertmanager")
                alert_lines = _show_alerts(running)
                args.previews_out.mkdir(parents=True, exist_ok=True)
                _progress(f"rendering dashboard previews into {args.previews_out}")
                previews = _previews(running, began, args.previews_out)
    except KeyboardInterrupt:
        _progress("interrupted; every process the demo started has been stopped")
        return 130
    print(render_summary(results, metrics_url, previews, CONFIGURED_MAX_NUM_SEQS, last))
    if alert_lines:
        print("\nAlerts that reached Alertmanager's receivers:")
        print("\n".join(alert_lines))
    if previews is not None:
        records = [json.loads(p.read_text()) for p in sorted(previews.glob("*.panels.json"))]
        print("\nPanels the previews drew without data:")
        print("\n".join(render_empty_panels(records)))
    overload, calm = results[0], results[-1]
    if overload.tax <= 0 or calm.tax != 0:
        _progress("unexpected: the overload should show a tax and the calm phase none")
        return 1
    return 0
