"""Re-time a random sample of a decision sweep's simulated probes, one at a
time, and compare with the `wall_s` its decision_probes.csv recorded.

A probe's recorded `wall_s` is the wall clock of the process that ran it:
it counts whatever else the machine did meanwhile (the other joblib job,
tests, a SIGSTOP that paused the sweep). Run here on a quiet machine, the
sample says how much of a sweep's summed probe time is the probes' own.
Each sampled probe is rebuilt from its row (key, rate, size) and checked
against the probe cache, when one is given: its config must hash to a
cached key and give the cached figures, so it is the very probe the sweep
ran.

    python experiments/benchmarks/retime_probes.py SWEEP_DIR --cache CACHE_DIR --sample 60
"""
from __future__ import annotations

import argparse
import csv
import dataclasses
import random
import sys
import time
from pathlib import Path

from testbed.config import RunConfig


def compose_point(point_dir: Path) -> RunConfig:
    """The sweep point's run config, from the overrides Hydra kept beside it."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR
    register_configs()
    overrides = OmegaConf.to_object(OmegaConf.load(point_dir / ".hydra" / "overrides.yaml"))
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", overrides))


def candidates(cfg: RunConfig, row: dict) -> list[RunConfig]:
    """The run configs a probe row may stand for: its key names model, hardware,
    N, deployment, link, L and the TBT target where the deployment reads it;
    where it does not, the run came from whichever target searched first."""
    from testbed.experiments.decision_search import judged_run, length_point, point_cfg
    from testbed.experiments.decision_slo import get_smoothness
    from testbed.experiments.deployments import deployments, replace_run
    from testbed.sim.config import ParallelConfig, load_link_preset
    from testbed.sim.cost_model import CostModel
    e = cfg.experiment
    model, hardware, n, label, link, L, tbt, *rest = row["key"].split("/")
    point = point_cfg(cfg, model, hardware)
    dep = next(d for d in deployments(e, int(n), point.parallel.tp * point.parallel.pp, e.reuse > 0)
               if d.label == label)
    point = replace_run(point, link=load_link_preset(link if link != "-" else e.links[0]))
    base = dep.apply(point)
    one_gpu = CostModel(point.model, point.hardware, ParallelConfig(), point.engine)
    out = []
    for target in (e.tbt_slos_ms if tbt == "-" else [float(tbt)]):
        run_cfg, _ = length_point(e, base, one_gpu, int(L), target)
        for name in e.smoothness:
            judged = judged_run(run_cfg, get_smoothness(name))
            if (judged is not run_cfg) == bool(rest):          # "no-slack": adaptive without banked slack
                out.append(judged)
    rate = float(row["rate"])
    return [replace_run(c, workload=dataclasses.replace(
        c.workload, rate=rate / max(1, c.workload.conversation_turns), num_requests=int(row["num_requests"])))
        for c in out]


def retime(run_cfg: RunConfig) -> tuple[float, float, int]:
    """Wall and CPU seconds of the probe's simulation (as the Prober times it), and requests finished."""
    from testbed.runtime.build import apply_sampling
    from testbed.runtime.sim import SimRuntime
    from testbed.workloads.build import build_workload
    requests = build_workload(run_cfg.workload, run_cfg.model.vocab_size, run_cfg.seed)
    apply_sampling(run_cfg, requests)
    t0, c0 = time.monotonic(), time.process_time()
    records = SimRuntime(run_cfg, log=lambda *_: None).run(requests).records
    return time.monotonic() - t0, time.process_time() - c0, sum(r.finished for r in records)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("sweep", type=Path, help="a sweep directory (or one point) holding decision_probes.csv files")
    p.add_argument("--cache", type=Path, help="the sweep's experiment.probe_cache: check each rebuilt probe")
    p.add_argument("--top", type=int, default=20, help="re-time the probes with the longest recorded wall_s")
    p.add_argument("--sample", type=int, default=40, help="and this many drawn at random from the rest")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from testbed.experiments.probe_cache import read_entries
    cached = {e["key"]: e for e in read_entries(args.cache) if e is not None} if args.cache else {}
    rows = []
    for csv_path in sorted(args.sweep.rglob("decision_probes.csv")):
        with open(csv_path) as f:
            rows += [(csv_path.parent, r) for r in csv.DictReader(f) if r["source"] == "sim"]
    unique = sorted({(r["key"], r["rate"]): (d, r) for d, r in rows}.values(), key=lambda dr: -float(dr[1]["wall_s"]))
    top, rest = unique[:args.top], unique[args.top:]
    sample = random.Random(args.seed).sample(rest, min(args.sample, len(rest)))
    total = sum(float(r["wall_s"]) for _, r in unique)
    print(f"{len(unique)} probes in {args.sweep}, recorded wall_s {total:.0f} s in all; re-timing the "
          f"{len(top)} longest and {len(sample)} of the rest (seed {args.seed})", flush=True)
    configs: dict[Path, RunConfig] = {}
    sums = {}
    for name, chosen in (("longest", top), ("sample", sample)):
        recorded = low = high = 0.0
        for point_dir, row in chosen:
            cfg = configs.setdefault(point_dir, compose_point(point_dir))
            wall, cpu = retime_row(cfg, row, cached)
            runs = int(row["runs"])
            # a lengthened probe's row sums every run it took; only its last (longest) run is rebuilt
            # here: the others together took between nothing and (runs - 1) times as long
            recorded, low, high = recorded + float(row["wall_s"]), low + wall, high + runs * wall
            print(f"{name:<8} {row['key']:<62} {float(row['rate']):>9.4g} {row['num_requests']:>6} recorded "
                  f"{float(row['wall_s']):>8.2f} s ({runs} runs)  now {wall:7.2f} s wall {cpu:7.2f} s CPU",
                  flush=True)
        sums[name] = (recorded, low, high)
        print(f"{name}: recorded {recorded:.1f} s, now {low:.1f}-{high:.1f} s", flush=True)
    top_recorded, top_low, top_high = sums["longest"]
    s_recorded, s_low, s_high = sums["sample"]
    rest_recorded = total - top_recorded
    if s_recorded:
        low = top_low + rest_recorded * s_low / s_recorded
        high = top_high + rest_recorded * s_high / s_recorded
        print(f"estimated probe time re-run alone: {low:.0f}-{high:.0f} s, against {total:.0f} s recorded "
              f"(the longest as re-timed, the rest scaled by the sample's ratio)")
    return 0


def retime_row(cfg: RunConfig, row: dict, cached: dict[str, dict]) -> tuple[float, float]:
    """The row's probe rebuilt, checked against the cache and the row, and re-timed."""
    from testbed.experiments.probe_cache import ProbeCache
    runs = candidates(cfg, row)
    if cached:
        # a deployment that reads no SLO may have been cached under both TBT targets: the same run
        runs = [c for c in runs if ProbeCache.key(c) in cached]
        if not runs:
            raise SystemExit(f"{row['key']} at {row['rate']}: no rebuilt config is in the cache")
    wall, cpu, finished = retime(runs[0])
    if finished != int(row["num_finished"]):
        raise SystemExit(f"{row['key']} at {row['rate']}: {finished} finished, the sweep had {row['num_finished']}")
    return wall, cpu


if __name__ == "__main__":
    sys.exit(main())
