"""Token-length distributions for prompts and outputs, written as short specs.

A spec is ``KIND:ARGS``:

- ``const:N``: always N;
- ``uniform:LO-HI``: integers from LO to HI, all as likely;
- ``normal:MEAN,SD``: rounded, clipped to [1, 4 x MEAN];
- ``lognormal:MEDIAN,SIGMA``: heavy-tailed, most requests short and a few very long;
- ``pareto:MIN,ALPHA``: heavier still (alpha 1.5 to 2.5 is typical of chat traffic).

Every kind takes an optional ``,max=N`` cap (the heavy tails need one: the model's context is
finite). Sampling takes the caller's :class:`random.Random`, so a seed fixes a whole sweep.

Example (a seeded generator draws the same lengths every run):

    >>> import random
    >>> dist = parse_distribution("lognormal:200,0.8,max=900", field="--output-tokens")
    >>> draws = [dist.sample(random.Random(1)) for _ in range(2)]
    >>> draws[0] == draws[1], 1 <= draws[0] <= 900
    (True, True)
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from kvtax.errors import InputError

__all__ = ["KINDS", "Distribution", "parse_distribution"]

KINDS = ("const", "uniform", "normal", "lognormal", "pareto")
_ARITY = {"const": 1, "uniform": 2, "normal": 2, "lognormal": 2, "pareto": 2}


@dataclass(frozen=True, slots=True)
class Distribution:
    kind: str
    a: float
    b: float = 0.0
    cap: int | None = None

    def sample(self, rng: random.Random) -> int:
        if self.kind == "const":
            value = self.a
        elif self.kind == "uniform":
            value = rng.randint(int(self.a), int(self.b))
        elif self.kind == "normal":
            value = min(max(1.0, rng.gauss(self.a, self.b)), 4 * self.a)
        elif self.kind == "lognormal":
            value = rng.lognormvariate(math.log(self.a), self.b)
        else:  # pareto
            value = self.a * rng.paretovariate(self.b)
        tokens = max(1, round(value))
        return min(tokens, self.cap) if self.cap is not None else tokens

    @property
    def upper(self) -> int | None:
        """The largest value this can give, or None for an uncapped tail."""
        if self.cap is not None:
            return self.cap
        if self.kind == "const":
            return int(self.a)
        if self.kind == "uniform":
            return int(self.b)
        if self.kind == "normal":
            return int(4 * self.a)
        return None

    def describe(self) -> str:
        args = {
            "const": f"{self.a:g}",
            "uniform": f"{self.a:g}-{self.b:g}",
        }.get(self.kind, f"{self.a:g},{self.b:g}")
        cap = f",max={self.cap}" if self.cap is not None else ""
        return f"{self.kind}:{args}{cap}"


def parse_distribution(spec: str, *, field: str) -> Distribution:
    """Parse ``spec``; raises :class:`InputError` naming ``field`` when it is not valid."""
    kind, sep, rest = spec.strip().partition(":")
    if not sep or kind not in KINDS:
        raise InputError(field, f"{spec!r} is not KIND:ARGS with KIND one of {', '.join(KINDS)}")
    parts = [p.strip() for p in rest.replace("-", ",", 1 if kind == "uniform" else 0).split(",")]
    cap: int | None = None
    if parts and parts[-1].startswith("max="):
        cap = _positive_int(parts.pop()[4:], field, spec)
    if len(parts) != _ARITY[kind]:
        raise InputError(field, f"{spec!r}: {kind} takes {_ARITY[kind]} number(s)")
    try:
        nums = [float(p) for p in parts]
    except ValueError:
        raise InputError(field, f"{spec!r}: {rest!r} holds a value that is not a number") from None
    if not all(math.isfinite(n) and n > 0 for n in nums):
        raise InputError(field, f"{spec!r}: every number must be positive")
    if kind == "uniform" and nums[1] < nums[0]:
        raise InputError(field, f"{spec!r}: the range's high end is below its low end")
    if kind in ("const", "uniform") and not all(n == int(n) for n in nums):
        raise InputError(field, f"{spec!r}: token counts must be whole numbers")
    return Distribution(kind, nums[0], nums[1] if len(nums) > 1 else 0.0, cap)


def _positive_int(text: str, field: str, spec: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise InputError(field, f"{spec!r}: max={text!r} is not a whole number") from None
    if value < 1:
        raise InputError(field, f"{spec!r}: max must be at least 1")
    return value
