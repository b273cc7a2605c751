"""The sweep over HTTP: requests to an OpenAI-compatible server, scrapes of its metrics page.

Each step holds one load level for ``step_seconds``: in ``concurrency`` mode that many clients
each send a request as soon as their previous one ended; in ``rate`` mode requests arrive as a
Poisson process. Then the step stops sending, waits for the requests in flight (up to
``drain_seconds``) and scrapes once more, so no request of one step runs into the next and the
engine's counter increases between a step's first and last scrape belong to that step alone.

Requests go to ``/v1/completions``, streamed, with ``ignore_eos`` (vLLM's extension; other
servers ignore it) so outputs are as long as asked, and prompts as token ids so their lengths
are exact and no two share a prefix (vLLM's prefix cache would otherwise shrink the demand).

Completed steps are appended to the caller's list as they finish: a sweep stopped by Ctrl-C
(the task cancelled) leaves every step measured so far in it.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import orjson

from kvtax.delivery.timing import SloTargets, StreamTiming
from kvtax.engine.normalize import ParseError, normalize
from kvtax.errors import InputError
from kvtax.figures.derive import EngineSettings
from kvtax.figures.window import Point, Window
from kvtax.tools.loadtest.measure import RequestRecord, StepResult, engine_step, measure_step
from kvtax.tools.loadtest.plan import LoadPlan

__all__ = ["Target", "check_target", "run_sweep"]

Progress = Callable[[str], None]
# Token ids of a prompt: low ids exist in every vocabulary, the tiny test model's included.
_TOKEN_IDS = (10, 500)
_CONNECT_TIMEOUT = 10.0
# A progress line this often inside a step.
_TICK_SECONDS = 10.0


@dataclass(frozen=True, slots=True)
class Target:
    url: str  # the server's base URL, without /v1
    metrics_url: str
    model: str


class _Engine:
    """The run's one window of scrapes; ``points`` slices it by time."""

    def __init__(self, target: Target, session: aiohttp.ClientSession) -> None:
        self.target = target
        self.session = session
        self.window = Window(window_seconds=float("inf"), max_points=1_000_000)
        self.failures = 0

    async def scrape(self) -> None:
        try:
            text = await _get_text(self.session, self.target.metrics_url)
            snap = normalize(text, timestamp=time.time())
        except (aiohttp.ClientError, TimeoutError, ParseError, InputError):
            self.failures += 1
            return
        self.window.observe(snap)

    def points(self, start: float, end: float) -> list[Point]:
        return [p for p in self.window.points(self.target.model) if start <= p.t <= end]


def load_session(max_in_flight: int) -> aiohttp.ClientSession:
    """The sweep's one session: at most ``max_in_flight`` connections, each closed after its
    answer (never reused), no total timeout (a stream lasts as long as its tokens take)."""
    # A connection of its own for every request, never a pooled one. vLLM's server arms its keep-
    # alive close (VLLM_HTTP_TIMEOUT_KEEP_ALIVE, 5 s) when it has written an answer's end. If the
    # sweep reads that end late, or vLLM's loop is busy when the next request comes so that the
    # timer falls due before the request is read, a reused connection is closed under the request:
    # "Server disconnected" before vLLM reads it. CI saw it twice: with aiohttp's 15 s keep-alive,
    # and again with idle connections dropped at 2 s, where a step beside CI's other lanes lost 1 of
    # 8 and 2 of 12 requests (TTFTs of 5.5 s showed how late the loops ran). A load generator must
    # not invent failures, and a loopback connect costs microseconds beside a generation.
    connector = aiohttp.TCPConnector(limit=max_in_flight, force_close=True)
    timeout = aiohttp.ClientTimeout(total=None, sock_connect=_CONNECT_TIMEOUT)
    return aiohttp.ClientSession(connector=connector, timeout=timeout)


async def _get_text(session: aiohttp.ClientSession, url: str) -> str:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=_CONNECT_TIMEOUT)) as resp:
        if resp.status != 200:
            raise InputError(url, f"answered HTTP {resp.status}")
        return await resp.text()


async def check_target(url: str, metrics_url: str | None, model: str | None) -> Target:
    """Reach the server and its metrics page once; name the flag that is wrong if not."""
    base = url.rstrip("/").removesuffix("/v1")
    metrics = metrics_url or f"{base}/metrics"
    async with aiohttp.ClientSession() as session:
        try:
            body = orjson.loads(await _get_text(session, f"{base}/v1/models"))
            model = model or str(body["data"][0]["id"])
        except InputError as exc:
            raise InputError("URL", f"{base}/v1/models {exc.message}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise InputError("URL", f"cannot reach {base}: {exc or type(exc).__name__}") from None
        except (orjson.JSONDecodeError, KeyError, IndexError, TypeError):
            raise InputError("--model", f"{base}/v1/models lists no model; pass --model") from None
        try:
            text = await _get_text(session, metrics)
            snap = normalize(text, timestamp=time.time())
        except InputError as exc:
            raise InputError("--metrics-url", f"{metrics} {exc.message}") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            raise InputError(
                "--metrics-url", f"cannot reach {metrics}: {exc or type(exc).__name__}"
            ) from None
        except ParseError as exc:
            raise InputError("--metrics-url", f"{metrics} is not a metrics page: {exc}") from None
    if model not in snap.models:
        found = ", ".join(sorted(m for m in snap.models if m)) or "none"
        raise InputError(
            "--metrics-url",
            f"{metrics} has no vLLM series for model {model!r} (models on the page: {found})",
        )
    return Target(base, metrics, model)


async def run_sweep(
    plan: LoadPlan,
    target: Target,
    steps: list[StepResult],
    progress: Progress,
    settings: EngineSettings | None = None,
) -> list[Point]:
    """Run every level of ``plan``, appending each measured step to ``steps``.

    Returns the whole run's points (for the run-wide recommendation)."""
    settings = settings or EngineSettings()
    rng = random.Random(plan.seed)
    async with load_session(plan.max_in_flight) as session:
        engine = _Engine(target, session)
        for index, level in enumerate(plan.levels):
            if index:
                await asyncio.sleep(plan.rest_seconds)
            progress(f"step {index + 1}/{len(plan.levels)}: {plan.mode} {level:g}")
            step = await _run_step(
                plan,
                target,
                session,
                engine,
                rng=rng,
                index=index,
                level=level,
                settings=settings,
                progress=progress,
            )
            steps.append(step)
            progress(describe(step, plan.mode))
        return list(engine.window.points(target.model))


def describe(step: StepResult, mode: str) -> str:
    e = step.engine
    tax = "-" if e.tax is None else f"{100 * e.tax:.1f}% ({e.tax_method})"
    kv = "-" if e.kv_usage_max is None else f"{100 * e.kv_usage_max:.0f}%"
    thr = "-" if step.throughput is None else f"{step.throughput:,.0f}"
    return (
        f"  {mode} {step.level:g}: {step.ok}/{step.requests} ok in {step.span:.1f} s, "
        f"throughput {thr} tok/s, goodput {step.goodput:,.0f} tok/s, "
        f"preemptions {e.preemptions if e.preemptions is not None else '-':g}, tax {tax}, "
        f"KV max {kv}"
    )


async def _run_step(
    plan: LoadPlan,
    target: Target,
    session: aiohttp.ClientSession,
    engine: _Engine,
    *,
    rng: random.Random,
    index: int,
    level: float,
    settings: EngineSettings,
    progress: Progress,
) -> StepResult:
    records: list[RequestRecord] = []
    tasks: set[asyncio.Task[None]] = set()
    start = time.time()
    await engine.scrape()
    deadline = time.monotonic() + plan.step_seconds
    scraper = asyncio.create_task(_scrape_every(engine, plan.scrape_interval))
    ticker = asyncio.create_task(_tick(records, tasks, progress))

    def launch() -> None:
        prompt = plan.prompt_tokens.sample(rng)
        output = plan.output_tokens.sample(rng)
        ids = [rng.randrange(*_TOKEN_IDS) for _ in range(prompt)]
        task = asyncio.create_task(
            _request(session, target, plan, prompt=ids, max_tokens=output, records=records)
        )
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    try:
        if plan.mode == "concurrency":
            await _closed_loop(int(level), deadline, launch, tasks)
        else:
            await _open_loop(
                level, deadline, launch, tasks, rng=rng, max_in_flight=plan.max_in_flight
            )
        await _drain(tasks, plan.drain_seconds)
    finally:
        await _stop((scraper, ticker), tasks)
    await engine.scrape()
    end = time.time()
    measured = engine_step(engine.points(start, end), settings)
    return measure_step(index, level, start=start, end=end, records=records, engine=measured)


async def _tick(
    records: list[RequestRecord], tasks: set[asyncio.Task[None]], progress: Progress
) -> None:
    """A progress line every few seconds of a step, so a long step shows it is alive."""
    began = time.monotonic()
    while True:
        await asyncio.sleep(_TICK_SECONDS)
        progress(
            f"  ... {time.monotonic() - began:.0f} s: {len(records)} done, {len(tasks)} in flight"
        )


async def _drain(tasks: set[asyncio.Task[None]], timeout: float) -> None:
    """Wait up to ``timeout`` for the requests in flight, then cancel the late ones.

    The late ones are awaited after the cancel, so none of them runs into the next step.
    """
    if tasks:
        _, late = await asyncio.wait(set(tasks), timeout=timeout)
        for task in late:
            task.cancel()
        if late:
            await asyncio.wait(late)


async def _stop(helpers: tuple[asyncio.Task[None], ...], tasks: set[asyncio.Task[None]]) -> None:
    """Stop the step's scraper and ticker, and cancel any request still in flight."""
    for helper in helpers:
        helper.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await helper
    for task in tasks:
        task.cancel()


async def _closed_loop(
    clients: int, deadline: float, launch: Callable[[], None], tasks: set[asyncio.Task[None]]
) -> None:
    """Keep ``clients`` requests in flight until the deadline."""
    while time.monotonic() < deadline:
        while len(tasks) < clients:
            launch()
        await asyncio.wait(
            set(tasks), timeout=deadline - time.monotonic(), return_when=asyncio.FIRST_COMPLETED
        )


async def _open_loop(
    rate: float,
    deadline: float,
    launch: Callable[[], None],
    tasks: set[asyncio.Task[None]],
    *,
    rng: random.Random,
    max_in_flight: int,
) -> None:
    """Poisson arrivals at ``rate`` per second until the deadline (none beyond the cap)."""
    next_at = time.monotonic() + rng.expovariate(rate)
    while next_at < deadline:
        await asyncio.sleep(max(0.0, next_at - time.monotonic()))
        if len(tasks) < max_in_flight:
            launch()
        next_at += rng.expovariate(rate)
    await asyncio.sleep(max(0.0, deadline - time.monotonic()))


async def _scrape_every(engine: _Engine, interval: float) -> None:
    while True:
        await asyncio.sleep(interval)
        await engine.scrape()


async def _request(
    session: aiohttp.ClientSession,
    target: Target,
    plan: LoadPlan,
    *,
    prompt: list[int],
    max_tokens: int,
    records: list[RequestRecord],
) -> None:
    body: dict[str, Any] = {
        "model": target.model,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0.0,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if plan.ignore_eos:
        body["ignore_eos"] = True
    began = time.monotonic()
    started = time.time()
    timing = StreamTiming(began, factor=plan.stall_factor, floor=plan.stall_min, keep_gaps=True)
    tokens = 0
    usage: dict[str, Any] | None = None
    error: str | None = None
    try:
        async with session.post(
            f"{target.url}/v1/completions",
            data=orjson.dumps(body),
            headers={"Content-Type": "application/json"},
        ) as resp:
            if resp.status != 200:
                error = f"HTTP {resp.status}: {(await resp.text())[:200]}"
            else:
                async for raw in resp.content:
                    line = raw.strip()
                    if not line.startswith(b"data:") or line == b"data: [DONE]":
                        continue
                    event = orjson.loads(line[5:])
                    if event.get("usage"):
                        usage = event["usage"]
                    if any(c.get("text") for c in event.get("choices") or ()):
                        timing.tokens_written(time.monotonic(), len(prompt) + tokens)
                        tokens += 1
    except asyncio.CancelledError:
        error = "cancelled (drain timeout or stop)"
        _record(records, started, timing, tokens=tokens, usage=usage, error=error, plan=plan)
        raise
    except (aiohttp.ClientError, TimeoutError, orjson.JSONDecodeError) as exc:
        error = f"{type(exc).__name__}: {exc}"
    _record(records, started, timing, tokens=tokens, usage=usage, error=error, plan=plan)


def _record(
    records: list[RequestRecord],
    started: float,
    timing: StreamTiming,
    *,
    tokens: int,
    usage: dict[str, Any] | None,
    error: str | None,
    plan: LoadPlan,
) -> None:
    completion = int(usage["completion_tokens"]) if usage else tokens
    ok = error is None and tokens > 0
    records.append(
        RequestRecord(
            started=started,
            ended=time.time(),
            ok=ok,
            completion_tokens=completion,
            prompt_tokens=int(usage["prompt_tokens"]) if usage else None,
            ttft=timing.ttft,
            gaps=tuple(timing.gaps or ()),  # kept: keep_gaps above
            stalls=len(timing.stalls),
            slo_met=ok and timing.meets(SloTargets(plan.slo_ttft, plan.slo_itl)),
            error=error if error is not None or ok else "empty response",
        )
    )
