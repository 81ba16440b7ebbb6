"""The contracts between scheduler, executor and engine: a `Batch` of slices in,
a `StepResult` out (README.md, "Architecture")."""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.request import Request


@dataclass
class ScheduledSlice:
    """`num_tokens` tokens of `request`, starting at its `num_computed_tokens`.
    A decode is a slice of 1 at the end of the request; a prefill chunk is a
    slice of many inside the prompt."""
    request: Request
    num_tokens: int

    @property
    def start(self) -> int:
        return self.request.num_computed_tokens

    @property
    def end(self) -> int:
        return self.request.num_computed_tokens + self.num_tokens

    @property
    def samples(self) -> bool:
        """True when this slice brings the request up to date, so the step
        samples its next token (the last chunk of a prompt, or a decode)."""
        return self.end == self.request.num_tokens

    @property
    def is_decode(self) -> bool:
        return self.start >= self.request.prompt_len


@dataclass
class Batch:
    slices: list[ScheduledSlice] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)   # requests evicted this step
    # what a budgeted policy planned (recorded in iterations.jsonl): the iteration's
    # token budget, and the duration its predictor expected (adaptive)
    token_budget: int | None = None
    predicted_s: float | None = None

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices)

    @property
    def num_decode_tokens(self) -> int:
        return sum(s.num_tokens for s in self.slices if s.is_decode)

    @property
    def num_prefill_tokens(self) -> int:
        return self.num_tokens - self.num_decode_tokens

    def __len__(self) -> int:
        return len(self.slices)

    def __bool__(self) -> bool:
        return bool(self.slices)


@dataclass
class StepResult:
    """What one executor step produced.

    `sampled` maps request id to the token sampled for each slice that
    `samples`; `kv_bytes_read` counts the KV that attention read (cached prefix
    plus the new tokens, per layer, K and V): the chunk re-read accounting."""
    sampled: dict[str, int]
    duration_s: float
    kv_bytes_read: int = 0
