"""A real worker process runs the torch threads `torch_threads` gives it, and
no more: on this 2-core machine two workers with more than one each would
fight over the cores (experiments/README.md, "decision"). Counted
from /proc while the worker serves: at torch_threads=1 its threads are the
engine's, the step watch's (runtime/step_watch.py), ZMQ's I/O and reaper
threads and numpy's OpenBLAS server (cores - 1 of them: 5 here, seen with
gdb), no intra-op pool; torch_threads=2 adds the pool's (7 here, 9 at 3).
Left at torch's default (a thread per core) both counts would be equal."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.config import register_configs
from testbed.model.config import CONF_DIR
from testbed.runtime.build import apply_sampling
from testbed.runtime.real import RealRuntime
from testbed.workloads.build import build_workload


def _children_threads() -> dict[int, int]:
    out = {}
    for task in Path(f"/proc/{os.getpid()}/task").iterdir():
        try:
            pids = (task / "children").read_text().split()
        except OSError:
            continue
        for pid in pids:
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out[int(pid)] = int(fields[17])
    return out


def _worker_threads(torch_threads: int) -> int:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", [
            "runtime=real", "model=tiny", "workload.num_requests=3", "workload.prompt_len=256",
            "workload.output_len=16", "wandb.mode=disabled", "progress=false", f"torch_threads={torch_threads}"]))
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    seen: dict[int, int] = {}

    def on_event(rt, ev) -> None:          # sampled while the worker serves, not while it starts
        if ev.kind == "tokens":
            for pid, n in _children_threads().items():
                seen[pid] = max(seen.get(pid, 0), n)

    result = RealRuntime(cfg, on_event=on_event).run(requests)
    assert all(r.finished for r in result.records)
    assert seen, "no worker process seen while serving"
    return max(seen.values())


@pytest.mark.slow            # two real runs: ~20 s here
def test_a_worker_runs_the_torch_threads_it_is_given():
    one, two = _worker_threads(1), _worker_threads(2)
    assert one <= 5, one
    assert two > one, (one, two)
