"""PoolState: what the frontend knows of each worker, kept by the mode
controller from the workers' events and read by the routers through the
read-only `PoolView` (README, "Architecture")."""
from __future__ import annotations

from collections import Counter
from typing import Protocol

from testbed.request import Request


class PoolView(Protocol):
    """Read-only: what a router may ask of a pool's workers."""

    def outstanding(self, worker_id: str) -> int:
        """Requests routed to the worker and not yet resolved."""

    def prompt_tokens(self, worker_id: str) -> int:
        """Prompt tokens routed to the worker and not yet prefilled."""

    def free_blocks(self, worker_id: str) -> int:
        """KV blocks the worker last reported free."""

    def cached_prefix_tokens(self, worker_id: str, request: Request) -> int:
        """Tokens of the request's prompt whose KV the worker could reuse."""


class PoolState:
    def __init__(self, num_blocks: dict[str, int]):
        self._outstanding: Counter[str] = Counter()
        self._prompt_tokens: Counter[str] = Counter()
        self._free_blocks = dict(num_blocks)

    # -- PoolView -------------------------------------------------------------------
    def outstanding(self, worker_id: str) -> int:
        return self._outstanding[worker_id]

    def prompt_tokens(self, worker_id: str) -> int:
        return self._prompt_tokens[worker_id]

    def free_blocks(self, worker_id: str) -> int:
        return self._free_blocks[worker_id]

    def cached_prefix_tokens(self, worker_id: str, request: Request) -> int:
        return 0        # the controllers here keep no prefix index

    # -- kept by the controller -------------------------------------------------------
    def add_outstanding(self, worker_id: str, n: int) -> None:
        self._outstanding[worker_id] += n

    def add_prompt_tokens(self, worker_id: str, n: int) -> None:
        self._prompt_tokens[worker_id] += n

    def set_free_blocks(self, worker_id: str, n: int) -> None:
        self._free_blocks[worker_id] = n
