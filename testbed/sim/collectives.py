"""TP all-reduce seconds from a measured table (operator_table.load_allreduce_table):
one topology's median all-reduce time by message size and world size, all
GPUs in one node. Between the measured sizes the time is interpolated in
log-log over a running median of neighbouring sizes; below the smallest it is the smallest's (latency-bound); past the
largest it grows in proportion to the size (bandwidth-bound)."""
from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import numpy as np

from testbed.sim.operator_table import load_allreduce_table


_WINDOW = 9


class AllReduceTable:
    def __init__(self, tables: Path, topology: str, world_size: int):
        rows = [(size, s) for n, per_node, size, s in load_allreduce_table(tables, topology)
                if n == world_size and per_node == world_size]
        if not rows:
            sizes = sorted({n for n, per_node, _, _ in load_allreduce_table(tables, topology) if n == per_node})
            raise ValueError(f"hardware.allreduce_table: '{topology}' has no all-reduce over {world_size} GPUs "
                             f"of one node (it has {sizes}); pick another parallel.tp, another table, "
                             "or allreduce_table='' for the ring on parallel.intra_node")
        by_size: dict[int, list[float]] = defaultdict(list)
        for size, s in rows:
            by_size[size].append(s)
        self.topology, self.world_size = topology, world_size
        self._log_size = np.log(np.array(sorted(by_size), dtype=np.float64))
        medians = np.array([np.median(by_size[k]) for k in sorted(by_size)])
        # a running median over 9 neighbouring sizes (the table steps by 8 KiB
        # at the small end): single repeats there scatter by 2x
        padded = np.pad(medians, _WINDOW // 2, mode="edge")
        smooth = np.array([np.median(padded[i:i + _WINDOW]) for i in range(len(medians))])
        self._log_s = np.log(smooth)
        self._max_size, self._max_s = float(np.exp(self._log_size[-1])), float(np.exp(self._log_s[-1]))

    def seconds(self, size_bytes: float) -> float:
        """Seconds of one all-reduce of `size_bytes` on every GPU."""
        if size_bytes >= self._max_size:
            return self._max_s * size_bytes / self._max_size
        return float(np.exp(np.interp(np.log(max(size_bytes, 1.0)), self._log_size, self._log_s)))
