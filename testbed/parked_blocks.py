"""ParkedBlocks: where each request's private blocks are, for the BlockManager
(testbed/block_manager.py), torch-free.

A private block (from Request.private_from's block on) is never hashed: no
other request can hold its tokens, so only its own request can want it back,
after a preemption. The BlockManager marks each one it commits with the serial
of its request's private run; this keeps the run's first block and serial while
the request holds blocks and, once it is freed, the run's blocks in order (a
park) under its id, for match_prefix to take back those still marked.

Parks die oldest first: a park's blocks were released together, its first
block last (free releases the tail first), and only its own request revives
them (taking the park), so the oldest park's first block is the next of theirs
an eviction takes. A park is dropped once its first block is no longer marked
with its serial, so the parks kept never outnumber the cached blocks.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from typing import NamedTuple


class Run(NamedTuple):
    """A request's private blocks: from its block table's index `first` on, marked `serial`."""
    first: int
    serial: int


class Park(NamedTuple):
    """A freed request's private run and its blocks, in block-table order from `run.first`."""
    run: Run
    blocks: list[int]


class ParkedBlocks:
    def __init__(self):
        self._runs: dict[str, Run] = {}                         # requests holding blocks
        self._parks: OrderedDict[str, Park] = OrderedDict()     # freed requests, oldest first

    def run(self, rid: str) -> Run | None:
        return self._runs.get(rid)

    def start(self, rid: str, run: Run) -> None:
        self._runs[rid] = run

    def holders(self):
        """The ids of the requests with a private run, for BlockManager.check_invariants."""
        return self._runs.keys()

    def release(self, rid: str, table: list[int], num_committed: int,
                still_marked: Callable[[int, int], bool]) -> None:
        """The request frees its blocks (`table`, the first `num_committed`
        committed): park its private run's committed blocks, and drop the
        oldest parks whose blocks are all gone (`still_marked(block, serial)`)."""
        run = self._runs.pop(rid, None)
        if run is None or num_committed <= run.first:
            return
        parks = self._parks
        parks.pop(rid, None)
        parks[rid] = Park(run, table[run.first:num_committed])
        while parks:
            oldest = next(iter(parks.values()))
            if still_marked(oldest.blocks[0], oldest.run.serial):
                break
            parks.popitem(last=False)

    def take(self, rid: str) -> Park | None:
        """The request's park, removed (match_prefix takes back what is still marked)."""
        return self._parks.pop(rid, None)

    def clear(self) -> None:
        """Forget every park (the prefix cache was reset); runs of live requests go on."""
        self._parks.clear()
