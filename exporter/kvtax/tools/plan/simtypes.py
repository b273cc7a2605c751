"""The value types of the scheduler simulation: a trace's requests, the engine settings, a result.

Kept apart from the simulator (:mod:`.simulate`) and its machinery (:mod:`.scheduler`) so the
length profile and the report can use them without the step model. Pure: no I/O.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvtax.errors import PlanError

__all__ = ["Request", "Result", "Settings"]


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace: lengths in tokens, ``arrival`` in scheduler steps.

    ``content`` groups requests whose token streams are identical (their blocks hash alike);
    None makes the request's content its own.
    """

    prompt: int
    output: int
    arrival: int = 0
    content: int | None = None


@dataclass(frozen=True, slots=True)
class Settings:
    """The engine settings a simulation runs with (vLLM's flag names)."""

    num_blocks: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int = 2048
    enable_prefix_caching: bool = True
    # Step cost model for relative throughput: a step costs 1 + scheduled tokens / knee, so a
    # step of `knee` tokens costs twice a bare decode step of a small batch.
    step_knee_tokens: float = 2048.0

    def check(self) -> None:
        for name, value in (
            ("--num-blocks", self.num_blocks),
            ("--block-size", self.block_size),
            ("--max-num-seqs", self.max_num_seqs),
            ("--max-num-batched-tokens", self.max_num_batched_tokens),
        ):
            if value <= 0:
                raise PlanError(name, f"must be a positive integer, not {value}")
        if self.num_blocks < 2:
            raise PlanError("--num-blocks", "must be at least 2 (one block is vLLM's null block)")


@dataclass(frozen=True, slots=True)
class Result:
    """What one simulated run did. Token counts follow kvtax's tax definition (docs/tax.md)."""

    settings: Settings
    requests: int
    finished: int
    preemptions: int
    resumes: int
    queried_tokens: int  # tokens of resumed requests looked up in the prefix cache
    hit_tokens: int  # of which found cached
    recomputed: int  # queried - hit: prefilled again
    prompt_computed: int  # first prefills, minus prefix-cache hits
    generated: int
    steps: int
    cost: float  # steps weighted by the step cost model
    mean_running: float
    preemptions_by_request: tuple[int, ...] = ()  # in trace order

    @property
    def tax(self) -> float:
        """recomputed / (computed prompt + generated + recomputed)."""
        total = self.prompt_computed + self.generated + self.recomputed
        return self.recomputed / total if total else 0.0

    @property
    def preemptions_per_request(self) -> float:
        return self.preemptions / self.requests if self.requests else 0.0

    @property
    def useful_per_cost(self) -> float:
        """Useful tokens (computed prompt + generated) per unit of step cost."""
        return (self.prompt_computed + self.generated) / self.cost if self.cost else 0.0
