"""Request-length profiles, and the traces the simulator runs, from flags or histograms.

A :class:`LengthProfile` is what sizing needs: p50 and p95 of prompt and output lengths. It
comes from flags, from vLLM's ``request_prompt_tokens`` and ``request_generation_tokens``
histograms (a vLLM ``/metrics`` page, or their increase over a range in Prometheus), or from a
running kvtax's ``/metrics``, which publishes only the sum of the two (p50 and p95).

:func:`trace` draws requests for the simulator: from the histograms when there are some (each
length uniform inside its bucket, the ``+Inf`` bucket clamped to the last finite bound), else
from a log-normal through the given p50 and p95. A seed makes it repeatable. Pure: the network
side lives in :mod:`kvtax.tools.plan.fetch`.

Example::

    >>> p = LengthProfile(prompt_p50=41, prompt_p95=41, output_p50=500, output_p95=500)
    >>> [(r.prompt, r.output) for r in trace(p, requests=2, seed=0)]
    [(41, 500), (41, 500)]
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from kvtax.engine.snapshot import Histogram
from kvtax.errors import PlanError
from kvtax.tools.plan.simtypes import Request

__all__ = [
    "KVTAX_LENGTH_P50",
    "KVTAX_LENGTH_P95",
    "LengthProfile",
    "arrivals",
    "profile_from_histograms",
    "profile_from_kvtax_page",
    "trace",
]

KVTAX_LENGTH_P50 = "kvtax_request_length_p50_tokens"
KVTAX_LENGTH_P95 = "kvtax_request_length_p95_tokens"
_Z95 = 1.6448536269514722  # the standard normal's 95th percentile


@dataclass(frozen=True, slots=True)
class LengthProfile:
    """p50/p95 prompt and output lengths in tokens, with the histograms they came from.

    Sizing uses the p95s only; the p50s (None when not given) shape the simulated trace.
    """

    prompt_p50: float | None
    prompt_p95: float
    output_p50: float | None
    output_p95: float
    prompt_histogram: Histogram | None = None
    output_histogram: Histogram | None = None
    source: str = "flags"

    def __post_init__(self) -> None:
        for name, value in (
            ("--prompt-p50", self.prompt_p50),
            ("--prompt-p95", self.prompt_p95),
            ("--output-p50", self.output_p50),
            ("--output-p95", self.output_p95),
        ):
            if value is not None and not (value > 0 and math.isfinite(value)):
                raise PlanError(name, f"must be a positive number of tokens, not {value}")
        if self.prompt_p50 is not None and self.prompt_p95 < self.prompt_p50:
            raise PlanError("--prompt-p95", "must not be below --prompt-p50")
        if self.output_p50 is not None and self.output_p95 < self.output_p50:
            raise PlanError("--output-p95", "must not be below --output-p50")

    @property
    def drawable(self) -> bool:
        """Whether :func:`trace` can draw from it: histograms, or both p50s beside the p95s."""
        if self.prompt_histogram is not None and self.output_histogram is not None:
            return True
        return self.prompt_p50 is not None and self.output_p50 is not None

    @property
    def p95_length(self) -> int:
        """p95 prompt + p95 output: an upper bound of the p95 request, as kvtax publishes it."""
        return math.ceil(self.prompt_p95 + self.output_p95)


def profile_from_histograms(prompt: Histogram, output: Histogram, source: str) -> LengthProfile:
    """The profile of two length histograms (already the increase over the range wanted)."""
    values: list[float] = []
    for name, hist in (("prompt", prompt), ("generation", output)):
        p50, p95 = hist.quantile(0.5), hist.quantile(0.95)
        if p50 is None or p95 is None:
            raise PlanError(source, f"no requests in the {name}-length histogram")
        values += [max(p50, 1.0), max(p95, 1.0)]
    return LengthProfile(
        prompt_p50=values[0],
        prompt_p95=values[1],
        output_p50=values[2],
        output_p95=values[3],
        prompt_histogram=prompt,
        output_histogram=output,
        source=source,
    )


def profile_from_kvtax_page(
    text: str, source: str, *, prompt_p50: float | None, prompt_p95: float | None, model: str | None
) -> LengthProfile:
    """The profile from kvtax's own /metrics: it publishes prompt + output only, so the prompt
    part must come from flags; the output is the rest."""
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for s in family.samples:
                if s.name in (KVTAX_LENGTH_P50, KVTAX_LENGTH_P95) and (
                    model is None or s.labels.get("model_name") == model
                ):
                    found[s.name] = max(found.get(s.name, 0.0), s.value)
    except ValueError as exc:
        raise PlanError(source, f"not a Prometheus exposition: {exc}") from exc
    if KVTAX_LENGTH_P95 not in found or KVTAX_LENGTH_P50 not in found:
        raise PlanError(source, f"has no {KVTAX_LENGTH_P95} (is it kvtax, with traffic?)")
    if prompt_p50 is None or prompt_p95 is None:
        raise PlanError(
            "--prompt-p50",
            "kvtax's /metrics gives prompt + output lengths only: give --prompt-p50 and "
            "--prompt-p95, or point --from-metrics at vLLM's own /metrics",
        )
    total50, total95 = found[KVTAX_LENGTH_P50], found[KVTAX_LENGTH_P95]
    if total50 <= prompt_p50 or total95 <= prompt_p95:
        raise PlanError("--prompt-p95", f"prompts longer than the request lengths in {source}")
    return LengthProfile(
        prompt_p50, prompt_p95, total50 - prompt_p50, total95 - prompt_p95, source=source
    )


def _from_histogram(hist: Histogram, rng: random.Random) -> int:
    u = rng.random() * hist.count
    lower_le, lower_count = 0.0, 0.0
    last_finite = max((le for le, _ in hist.buckets if math.isfinite(le)), default=1.0)
    for le, count in hist.buckets:
        if count > u and count > lower_count:
            upper = last_finite if math.isinf(le) else le
            low = min(lower_le, upper)
            return max(1, round(low + (upper - low) * (u - lower_count) / (count - lower_count)))
        lower_le, lower_count = le, count
    return max(1, round(last_finite))


def _lognormal(p50: float, p95: float, rng: random.Random) -> int:
    sigma = math.log(p95 / p50) / _Z95
    return max(1, round(p50 * math.exp(sigma * rng.gauss(0.0, 1.0))))


def trace(
    profile: LengthProfile,
    *,
    requests: int,
    seed: int,
    max_length: int | None = None,
    shared_content: bool = False,
) -> list[Request]:
    """``requests`` requests drawn from ``profile``, all arriving at step 0 (see
    :func:`arrivals` for a rate). Lengths above ``max_length`` are cut, as vLLM does with
    ``max_tokens``. ``shared_content`` makes every token stream identical (one prompt, greedy)."""
    if requests <= 0:
        raise PlanError("--requests", f"must be a positive integer, not {requests}")
    rng = random.Random(seed)
    out = []
    for _ in range(requests):
        if profile.prompt_histogram is not None and profile.output_histogram is not None:
            prompt = _from_histogram(profile.prompt_histogram, rng)
            output = _from_histogram(profile.output_histogram, rng)
        elif profile.prompt_p50 is not None and profile.output_p50 is not None:
            prompt = _lognormal(profile.prompt_p50, profile.prompt_p95, rng)
            output = _lognormal(profile.output_p50, profile.output_p95, rng)
        else:
            raise PlanError("--prompt-p50", "the simulated trace needs the p50 lengths too")
        if max_length is not None and prompt + output > max_length:
            prompt = min(prompt, max_length - 1)
            output = max_length - prompt
        out.append(Request(prompt=prompt, output=output, content=0 if shared_content else None))
    return out


def arrivals(requests: list[Request], *, per_step: float, seed: int) -> list[Request]:
    """The same requests arriving as a Poisson process of ``per_step`` requests per step."""
    if per_step <= 0:
        raise PlanError("--rate", f"must be positive, not {per_step}")
    rng = random.Random(seed + 1)
    at = 0.0
    out = []
    for r in requests:
        out.append(Request(r.prompt, r.output, int(at), r.content))
        at += rng.expovariate(per_step)
    return out
