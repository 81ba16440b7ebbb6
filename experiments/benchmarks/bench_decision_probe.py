"""One decision-study probe on the simulator, timed: the deployment's
SimRuntime.run on the decision workload (prompts lognormal around L, 128-token
answers, Poisson arrivals), after a warm-up construction so the one-time
table pricing is not counted.

    python experiments/benchmarks/bench_decision_probe.py disagg-2P2D --context-len 4096 --rate 10 --requests 800

Deployments are decision-full's at --num-gpus (`--list` names them). The
figures in experiments/README.md ("Simulator speed") came
from this, each code's tree as the working directory."""
from __future__ import annotations

import argparse
import dataclasses
import time

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.config import register_configs
from testbed.experiments.decision_search import _workload, point_cfg
from testbed.experiments.deployments import deployments, replace_run
from testbed.model.config import CONF_DIR
from testbed.runtime.build import apply_sampling
from testbed.runtime.sim import SimRuntime
from testbed.sim.config import load_link_preset
from testbed.workloads.build import build_workload


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("deployment", nargs="?", default="disagg-2P2D")
    p.add_argument("--context-len", type=int, default=4096)
    p.add_argument("--rate", type=float, default=10.0, help="requests/s of the deployment")
    p.add_argument("--requests", type=int, default=800)
    p.add_argument("--num-gpus", type=int, default=4)
    p.add_argument("--model", default="llama3-8b")
    p.add_argument("--hardware", default="h100-sxm")
    p.add_argument("--link", default="rdma-400")
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--list", action="store_true", help="the deployments at --num-gpus, then exit")
    args = p.parse_args()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", ["experiment=decision-full", "wandb.mode=disabled",
                                                     "progress=false"]))
    e = cfg.experiment
    point = point_cfg(cfg, args.model, args.hardware)
    point = replace_run(point, link=load_link_preset(args.link))
    deps = {d.label: d for d in deployments(e, args.num_gpus, point.parallel.tp * point.parallel.pp, False)}
    if args.list or args.deployment not in deps:
        print("deployments:", ", ".join(deps))
        return 0 if args.list else 2
    run_cfg = replace_run(deps[args.deployment].apply(point), workload=dataclasses.replace(
        _workload(e, args.context_len), rate=args.rate, num_requests=args.requests))
    requests = build_workload(run_cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(run_cfg, requests)
    SimRuntime(run_cfg, log=lambda *_: None)          # prices the tables once (cached per process)
    for _ in range(args.repeat):
        sim = SimRuntime(run_cfg, log=lambda *_: None)
        start = time.perf_counter()
        sim.run(list(requests))
        wall = time.perf_counter() - start
        print(f"{args.deployment} L={args.context_len} rate={args.rate} requests={len(requests)}: "
              f"run {wall:.2f} s; iterations run ahead {sim.num_run_ahead}, on the short path {sim.num_steady}, "
              f"in DecodeRuns {sim.num_in_runs}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
