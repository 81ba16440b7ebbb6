"""Routers: which worker of a pool serves a request, as classes chosen by name
(`router=`, `prefill_router=`, `decode_router=`). A router sees the live
candidates and a read-only view of the pool (modes/pool.py), never the
controller. Ties go by worker id, so a seeded run routes the same way twice.
A router that estimates times (`needs_context`) is built with a RouterContext."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Callable, ClassVar

from testbed.modes.pool import PoolView
from testbed.request import Request
from testbed.schedulers.context import StepTimePredictor


@dataclass(frozen=True)
class RouterContext:
    """What an estimating router reads beyond the pool: the cost model's
    step-time predictor, how long n bytes take from the KV store, and the KV
    bytes of one token."""
    predictor: StepTimePredictor
    store_transfer_s: Callable[[float], float]
    kv_bytes_per_token: int
    token_budget: int                      # a prefill worker's tokens per iteration (its chunk)


class Router(ABC):
    name: ClassVar[str]
    needs_context: ClassVar[bool] = False

    @abstractmethod
    def pick(self, request: Request, candidates: list[str], pool: PoolView) -> str:
        """One of `candidates` (live workers, sorted by id, never empty)."""

    def planned(self, candidates: list[str], k: int) -> str | None:
        """The candidate the k-th pick from now (0: the next) will choose,
        where that depends on neither the request nor the pool; else None
        (the default). The simulator runs a replica ahead up to the next
        arrival planned for it (runtime/sim.py)."""
        return None


class RoundRobin(Router):
    name = "round_robin"

    def __init__(self) -> None:
        self._next = 0

    def pick(self, request, candidates, pool):
        self._next += 1
        return candidates[(self._next - 1) % len(candidates)]

    def planned(self, candidates, k):
        return candidates[(self._next + k) % len(candidates)]


class LeastOutstanding(Router):
    name = "least_outstanding"

    def pick(self, request, candidates, pool):
        return min(candidates, key=lambda w: (pool.outstanding(w), w))


class MostFreeBlocks(Router):
    """The worker with the most free KV blocks (the highest id on a tie)."""
    name = "most_free_blocks"

    def pick(self, request, candidates, pool):
        return max(candidates, key=lambda w: (pool.free_blocks(w), w))


class LeastPromptTokens(Router):
    name = "least_prompt_tokens"

    def pick(self, request, candidates, pool):
        return min(candidates, key=lambda w: (pool.prompt_tokens(w), w))


ROUTERS: dict[str, type[Router]] = {}


def register_router(cls: type[Router]) -> type[Router]:
    ROUTERS[cls.name] = cls
    return cls


for _cls in (RoundRobin, LeastOutstanding, MostFreeBlocks, LeastPromptTokens):
    register_router(_cls)


def make_router(name: str, field_name: str = "router",
                context: Callable[[], RouterContext] | None = None) -> Router:
    """`context` builds the RouterContext of a router that needs one."""
    if name not in ROUTERS:
        raise ValueError(f"{field_name}='{name}' is not known; choose one of: {', '.join(sorted(ROUTERS))}")
    cls = ROUTERS[name]
    if not cls.needs_context:
        return cls()
    if context is None:
        raise ValueError(f"{field_name}='{name}' estimates TTFT and is only for mode=kvstore's prefill pool")
    return cls(context())
