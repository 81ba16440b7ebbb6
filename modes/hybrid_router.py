"""Hybrid routers: which pool of `mode=hybrid` serves a request, the
colocated one or the P/D pools (classes chosen by name, `hybrid.router`).
The worker within the chosen pool is then picked by that pool's own router
(modes/routers.py). `length_threshold` is Dynamo's conditional
disaggregation: a prompt of `threshold` tokens or more is disaggregated. A
policy that also reads load or cache hits (llm-d) would be another class
here, reading the same PoolView."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar

from testbed.modes.pool import PoolView
from testbed.request import Request


class HybridRouter(ABC):
    name: ClassVar[str]

    def __init__(self, threshold: int):
        self.threshold = threshold

    @abstractmethod
    def disaggregates(self, request: Request, pool: PoolView) -> bool:
        """True: the P/D pools serve the request; False: the colocated pool."""


class LengthThreshold(HybridRouter):
    name = "length_threshold"

    def disaggregates(self, request, pool):
        return request.prompt_len >= self.threshold


HYBRID_ROUTERS: dict[str, type[HybridRouter]] = {LengthThreshold.name: LengthThreshold}


def make_hybrid_router(name: str, threshold: int) -> HybridRouter:
    if name not in HYBRID_ROUTERS:
        raise ValueError(f"hybrid.router='{name}' is not known; choose one of: {', '.join(sorted(HYBRID_ROUTERS))}")
    return HYBRID_ROUTERS[name](threshold)
