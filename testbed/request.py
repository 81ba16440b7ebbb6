"""Request: the unit that flows from the workload through the scheduler, the
engine and (in disagg mode) from a prefill worker to a decode worker.

There is no prefill or decode phase stored here: a request has tokens (prompt
plus outputs so far) and `num_computed_tokens` (how many of them have KV in the
cache). A step computes some of the missing ones; when the request has caught
up, the step samples its next token.
"""
from __future__ import annotations

import enum
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np


class RequestStatus(str, enum.Enum):
    WAITING = "waiting"          # queued, holds no KV blocks
    RUNNING = "running"          # scheduled at least once, holds KV blocks
    FINISHED = "finished"        # generated max_tokens (or EOS when enabled)
    ABORTED = "aborted"          # cancelled by the client
    FAILED = "failed"            # a fault ended it (see Request.error)


@dataclass(frozen=True)
class SamplingParams:
    """temperature 0 is greedy; `seed` makes temperature sampling reproducible
    per request whatever batch it lands in."""
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    ignore_eos: bool = True
    eos_token_id: int | None = None


@dataclass(eq=False)
class Request:
    request_id: str
    prompt_token_ids: Sequence[int]      # a list, an int64 array, or a lazy synthetic sequence (testbed.workloads)
    max_tokens: int
    arrival_s: float = 0.0
    sampling: SamplingParams = field(default_factory=SamplingParams)
    # tokens from this index on are the request's own: no other request of its
    # workload holds them at the same place (a synthetic prompt drawn from its
    # own stream); None: not known. The prefix cache need not hash the blocks
    # from there on to find them (testbed/block_manager.py)
    private_from: int | None = None

    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    output_token_ids: list[int] = field(default_factory=list)
    num_preemptions: int = 0
    error: str | None = None
    # engine-side timestamps (seconds on the worker's clock: wall or virtual)
    first_scheduled_s: float | None = None
    token_times_s: list[float] = field(default_factory=list)
    finish_s: float | None = None
    # len(prompt_token_ids), kept: the prompt never changes, and its length is
    # read for every slice of every step (a lazy prompt's len is a Python call)
    prompt_len: int = field(init=False)

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise ValueError(f"request {self.request_id}: max_tokens={self.max_tokens} must be >= 1")
        self.prompt_len = len(self.prompt_token_ids)
        if self.prompt_len == 0:
            raise ValueError(f"request {self.request_id}: the prompt is empty; give at least one token")
        if self.private_from is not None and self.private_from < 0:
            raise ValueError(f"request {self.request_id}: private_from={self.private_from} must be >= 0 or None")

    @property
    def num_tokens(self) -> int:
        return self.prompt_len + len(self.output_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_prefill(self) -> bool:
        """Still computing prompt tokens (a chunk), rather than decoding."""
        return self.num_computed_tokens < self.prompt_len

    def token_ids(self, start: int, end: int) -> list[int]:
        """Tokens [start, end) of prompt + outputs."""
        p = self.prompt_len
        if end <= p:
            return list(self.prompt_token_ids[start:end])
        if start >= p:
            return self.output_token_ids[start - p:end - p]
        return list(self.prompt_token_ids[start:p]) + self.output_token_ids[:end - p]

    def token_array(self, start: int, end: int) -> np.ndarray:
        """Tokens [start, end) of prompt + outputs as an int64 array: one call
        for a lazy prompt's slice (its `numpy`), no list of Python ints."""
        p = self.prompt_len
        prompt = self.prompt_token_ids
        if start >= p:
            return np.array(self.output_token_ids[start - p:end - p], dtype=np.int64)
        numpy = getattr(prompt, "numpy", None)
        head = numpy(start, min(end, p)) if numpy is not None else np.asarray(prompt[start:min(end, p)], dtype=np.int64)
        if end <= p:
            return head
        return np.concatenate([head, np.array(self.output_token_ids[:end - p], dtype=np.int64)])

    def all_token_ids(self) -> list[int]:
        return list(self.prompt_token_ids) + self.output_token_ids

    def reset_for_recompute(self) -> None:
        """Preemption by recompute: forget the KV, keep the outputs; the outputs
        are recomputed as part of the (longer) prompt-like prefix."""
        self.num_computed_tokens = 0
        self.num_preemptions += 1
        self.status = RequestStatus.WAITING

    def is_finished_generating(self) -> bool:
        if self.num_output_tokens >= self.max_tokens:
            return True
        sp = self.sampling
        return (not sp.ignore_eos and sp.eos_token_id is not None and bool(self.output_token_ids)
                and self.output_token_ids[-1] == sp.eos_token_id)
