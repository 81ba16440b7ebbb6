"""experiment.parallel: the decision study's sweeps (decision_grid.py) as
Ray tasks, one CPU each. With no `ray.address` a local cluster starts for
the study (testbed/launchers/ray.py `connect`: node on loopback, inside a
private loopback-only network namespace unless ray.private_netns=false)
with as many CPUs as `parallel` says (auto: every core this process may run
on), and stops with it, on an error or Ctrl-C too; with one the study joins
that cluster and leaves it running.

A task whose worker process dies is run once more by Ray (max_retries=1);
dying again, its sweep's rows come back flagged (decision_grid.died_rows)
and the other sweeps go on. Each task opens the probe cache itself (a file
of its own, probe_cache.py), reports its probes and cells to a counter
actor for the progress bar, and returns its log lines, printed as it ends."""
from __future__ import annotations

import os

from testbed.config import RunConfig
from testbed.experiments.decision_grid import (GridProgress, Sweep, SweepResult, cell_of, died_rows, run_sweep,
                                                runs_per_rate)
from testbed.experiments.probe_cache import ProbeCache


def num_workers(parallel: str) -> int:
    """experiment.parallel as a number of processes (auto: the cores this process may run on)."""
    return len(os.sched_getaffinity(0)) if parallel == "auto" else int(parallel)


class _Tally:
    """The Ray actor counting each sweep's probes and cells so far (the driver polls it)."""

    def __init__(self) -> None:
        self.done: dict[int, tuple[int, list]] = {}

    def update(self, index: int, probes: int, cells: list) -> None:
        self.done[index] = (probes, cells)

    def read(self) -> dict[int, tuple[int, list]]:
        return self.done


def _sweep_task(cfg: RunConfig, sweep: Sweep, tally) -> SweepResult:
    """One sweep in a Ray worker."""
    logs: list[str] = []
    e = cfg.experiment
    cache = ProbeCache(e.probe_cache, lambda *_: None) if e.probe_cache else None
    try:
        result = run_sweep(cfg, sweep, logs.append, cache,
                           lambda probes, cells: tally.update.remote(sweep.index, probes, cells))
    finally:
        if cache is not None:
            cache.close()
    result.logs = logs
    return result


def run_ray(cfg: RunConfig, grid: list[Sweep], workers: int, log) -> list[SweepResult]:
    """Every sweep of `grid` as a Ray task; the results in the grid's order."""
    import ray
    from ray.exceptions import NodeDiedError, WorkerCrashedError

    from testbed.launchers.ray import connect
    initialised = connect(cfg.ray.address, cfg.runtime.host, workers, cfg.ray.private_netns,
                          cfg.ray.start_timeout_s, log_to_driver=False)
    bar = GridProgress(cfg, grid)
    try:
        log(f"decision: {len(grid)} sweeps as Ray tasks on {ray.cluster_resources().get('CPU', 0):g} CPUs"
            + ("" if cfg.ray.address is None else f" of the cluster at {cfg.ray.address}"))
        tally = ray.remote(num_cpus=0)(_Tally).remote()
        task = ray.remote(num_cpus=1, max_retries=1, retry_exceptions=False)(_sweep_task)
        # the longest first: the last to start sets the study's end (the results merge by index)
        order = sorted(grid, key=lambda s: tuple(-n for n in runs_per_rate(cfg, s)) + (s.index,))
        refs = {task.options(name=f"decision-sweep-{s.index}").remote(cfg, s, tally): s for s in order}
        results: dict[int, SweepResult] = {}
        pending = list(refs)
        while pending:
            done, pending = ray.wait(pending, num_returns=1, timeout=1.0)
            for ref in done:
                sweep = refs[ref]
                try:
                    result = ray.get(ref)
                except (WorkerCrashedError, NodeDiedError):
                    result = died_rows(cfg, sweep, log)
                else:
                    for line in result.logs:
                        log(line)
                results[sweep.index] = result
                bar.update(sweep.index, len(result.probe_rows), [cell_of(r) for r in result.rows])
            for index, (probes, cells) in ray.get(tally.read.remote()).items():
                if index not in results:
                    bar.update(index, probes, cells)
        return [results[s.index] for s in grid]
    finally:
        bar.close()
        if initialised:
            ray.shutdown()        # a local cluster stops with it; a joined one only loses this driver
