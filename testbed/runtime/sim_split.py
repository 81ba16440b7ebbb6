"""A simulated run split over processes (`runtime.sim_processes=N`).

A colocated run behind a router that plans its picks (round_robin: they
depend on the arrival's place alone, Router.planned) with no frontend hop
(the GPU presets) is R replicas that never touch one another: only an
arrival reaches a replica, and no replica's events reach the routing. So N
child processes
(forked: each has the config and the workload as they stand) each simulate
a group of the replicas on the requests the round robin sends them, every
one with all R workers built under their own names and indices (a worker's
jitter stream and its place in the iteration order are the single run's),
and write their records to a part directory (testbed/record_part.py). The
parent merges the parts into the run directory in the single run's order
(requests by arrival, iterations by the instant the frontend received them,
ties in worker order) and feeds its RunStats the same records in that
order: requests.jsonl, iterations.jsonl and summary.json are the
single-process run's, byte for byte (tests/test_sim_split.py).

A request that fails at arrival (past the model's context, or bigger than
any replica's KV cache) takes no pick; the first part records it.

A run this does not apply to (another mode or router, a frontend hop, no run
directory) says why once and runs in one process.
"""
from __future__ import annotations

import itertools
import multiprocessing
import shutil
import sys
import tempfile
import traceback
from collections import deque
from collections.abc import Iterable, Iterator
from multiprocessing.connection import Connection, wait
from pathlib import Path

import numpy as np

from testbed.config import RunConfig
from testbed.modes.colocated import ColocatedController
from testbed.modes.routers import Router
from testbed.record_part import INDEX_FILE, PartLog, merge_parts
from testbed.request import Request
from testbed.run_stats import RunStats
from testbed.runtime.deployment import RunResult, build_mode, record_log


def split_groups(cfg: RunConfig, record_dir) -> tuple[list[list[str]] | None, str]:
    """The replica groups the run's parts simulate (worker ids, in worker
    order), or None and why it runs in one process."""
    n = cfg.runtime.num_sim_processes()
    if n <= 1:
        return None, f"runtime.sim_processes={cfg.runtime.sim_processes} is one process"
    if cfg.hardware.frontend_hop_ms or cfg.hardware.frontend_message_ms:
        return None, (f"hardware={cfg.hardware.name} has a frontend hop (frontend_hop_ms, frontend_message_ms): "
                      "one frontend orders every replica's messages")
    if record_dir is None:
        return None, "no run directory to merge the parts into"
    mode = build_mode(cfg)
    controller = mode.controller(mode.workers(), lambda worker_id, command: None, False)
    if type(controller) is not ColocatedController or controller.router.planned(controller.replicas, 0) is None:
        return None, (f"mode={cfg.mode} router={cfg.router}: only colocated replicas behind a router that plans "
                      "its picks (round_robin) are apart")
    workers = [w.worker_id for w in mode.workers()]
    if len(workers) < 2:
        return None, f"{len(workers)} replica: nothing to split"
    n = min(n, len(workers))
    return [workers[g::n] for g in range(n)], ""


class PlannedRouter(Router):
    """A part's router: the picks the run's router made, in order (`targets`
    grows as the part's requests are drawn, ahead of the clock)."""
    name = "planned"

    def __init__(self, targets: deque[str]) -> None:
        self.targets = targets

    def pick(self, request, candidates, pool):
        target = self.targets.popleft()
        if target not in candidates:
            raise AssertionError(f"planned router: {target} is not among {candidates}")
        return target

    def planned(self, candidates, k):
        return self.targets[k] if k < len(self.targets) else None


def run_split(cfg: RunConfig, requests: Iterable[Request], record_dir, groups: list[list[str]],
              log=None) -> RunResult:
    """Simulate `groups` in a child process each and merge their records
    into `record_dir`; the RunResult of the single-process run."""
    if isinstance(requests, list):
        requests = sorted(requests, key=lambda r: r.arrival_s)    # as Arrivals takes a list
    workers = [w.worker_id for w in build_mode(cfg).workers()]      # the run's worker order
    parts_dir = Path(tempfile.mkdtemp(prefix=".sim-parts-", dir=record_dir))
    fork = multiprocessing.get_context("fork")
    children, conns = [], []
    try:
        for index, group in enumerate(groups):
            receive, send = fork.Pipe(duplex=False)
            child = fork.Process(target=_part, name=f"sim-part-{index}", daemon=True,
                                 args=(cfg, requests, workers, group, index, parts_dir / f"part-{index}",
                                       send, log))
            child.start()
            send.close()
            children.append(child)
            conns.append(receive)
        results = _collect(children, conns)
        records = record_log(cfg, record_dir)
        merge_parts([parts_dir / f"part-{i}" for i in range(len(groups))], [r["stats"] for r in results], records)
        records.close()
    finally:
        for child in children:
            if child.is_alive():
                child.kill()
            child.join()
        for conn in conns:
            conn.close()
        shutil.rmtree(parts_dir, ignore_errors=True)
    owner = {w: results[i] for i, group in enumerate(groups) for w in group}
    return RunResult(records, {w: owner[w]["worker_stats"][w] for w in workers},
                     max(r["duration_s"] for r in results))


def _collect(children: list, conns: list[Connection]) -> list[dict]:
    """Each part's result, as they come; a part that failed or died stops the run, named."""
    results: list[dict | None] = [None] * len(children)
    waiting = dict(zip(conns, range(len(conns))))
    while waiting:
        for conn in wait(list(waiting)):
            index = waiting.pop(conn)
            try:
                kind, payload = conn.recv()
            except EOFError:
                children[index].join()
                raise RuntimeError(f"simulation part {index} died (exit code {children[index].exitcode}) "
                                   "before reporting; run with runtime.sim_processes=1 to see it fail") from None
            if kind == "error":
                raise RuntimeError(f"simulation part {index} failed:\n{payload}")
            results[index] = payload
    return results


def _part(cfg: RunConfig, requests: Iterable[Request], workers: list[str], group: list[str], index: int,
          part_dir: Path, conn: Connection, log) -> None:
    """A child: the run's workers (in the run's order), the requests the
    run's router sends to `group` (and, in the first part, those that fail
    at arrival)."""
    from testbed.runtime.sim import SimRuntime
    try:
        targets: deque[str] = deque()
        arrivals: list[int] = []          # each of this part's arrivals' place among the run's
        records = PartLog(RunStats(cfg.slo.ttft_ms, cfg.slo.tpot_ms), part_dir,
                          {w: i for i, w in enumerate(workers)}, writer_after=cfg.runtime.record_writer_after)
        runtime = SimRuntime(cfg, log=log if index == 0 else (lambda line: None), records=records)
        controller = runtime.controller
        if not isinstance(controller, ColocatedController):
            raise AssertionError(f"a split run needs colocated replicas, got {type(controller).__name__}")
        controller.router = PlannedRouter(targets)
        # a controller of the run's own, never sent an arrival, plans where each goes
        planner = runtime.mode.controller(runtime.workers, lambda worker_id, command: None, False)
        mine = _routed_to(requests, planner, set(group), index == 0, targets, arrivals)
        result = runtime.run(mine)
        np.asarray(arrivals, dtype=np.int64).tofile(part_dir / INDEX_FILE)
        conn.send(("ok", {"worker_stats": result.worker_stats, "duration_s": result.duration_s,
                          "stats": records.stats}))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        sys.exit(1)
    finally:
        conn.close()


def _routed_to(requests: Iterable[Request], planner: ColocatedController, group: set[str], failures: bool,
               targets: deque[str], arrivals: list[int]) -> Iterator[Request]:
    """The requests of the run's arrival stream that go to `group` by the
    planner's plan of the whole stream (ColocatedController.planned_targets:
    the run's picks; "" for a request that fails at arrival without a pick,
    which the part with `failures` records), each one's target appended to
    `targets` and its place among the run's arrivals to `arrivals` as it is
    drawn."""
    ahead, drawn = itertools.tee(requests)
    plan = planner.planned_targets(ahead)
    for place, req in enumerate(drawn):
        target = next(plan, None)
        if target is None:
            raise AssertionError(f"router {planner.router.name} cannot say where arrival {place} goes")
        if not target:            # fails at arrival
            if not failures:
                continue
        elif target in group:
            targets.append(target)
        else:
            continue
        arrivals.append(place)
        yield req
