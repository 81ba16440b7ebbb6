"""One real-engine probe of `experiment=decision-real`, its records kept: the
deployment's worker processes on this CPU, the decision workload at L
(prompts lognormal around L, answers of --output-len tokens, Poisson
arrivals) at --rate requests/s of the deployment, judged as the study judges
it (the steady window, p99 TTFT and p99 TBT), then where its late TBT gaps
came from (testbed/analysis/late_gaps.py on the kept records).

    python experiments/benchmarks/bench_decision_real_probe.py adaptive --context-len 16384 --rate 0.0688 \\
        --requests 30 --output-len 32 --out /tmp/probe16k

The study's own probes keep the same records (real_probes/NNN of its run
directory); this re-runs one point alone, e.g. with another `--set`
(`--set adaptive.tbt_quantile=0.999`). Judged by p99 TBT, adaptive spends no
banked slack, as in the study (decision_search.judged_run; --keep-slack: it
does). Needs a quiet machine: the probe runs
on the wall clock."""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.analysis.late_gaps import late_gaps_report
from testbed.config import register_configs
from testbed.experiments.decision_real import RealProbes, real_point
from testbed.experiments.decision_search import isolated_s, judged_run, length_point, point_cfg
from testbed.experiments.decision_slo import get_smoothness
from testbed.experiments.deployments import deployments, replace_run
from testbed.model.config import CONF_DIR
from testbed.runtime.build import apply_sampling
from testbed.sim.config import ParallelConfig, load_link_preset
from testbed.sim.cost_model import CostModel
from testbed.steady_state import SteadyRule
from testbed.workloads.build import build_workload



def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("deployment", help="a decision deployment label: sarathi-512, adaptive, disagg-1P1D, ...")
    p.add_argument("--context-len", type=int, default=16384)
    p.add_argument("--rate", type=float, required=True, help="requests/s of the deployment")
    p.add_argument("--requests", type=int, required=True)
    p.add_argument("--output-len", type=int, default=32)
    p.add_argument("--tbt-ms", type=float, default=100.0)
    p.add_argument("--keep-slack", action="store_true",
                   help="adaptive spends banked slack even though p99 TBT judges it (the study's older setting)")
    p.add_argument("--set", action="append", default=[], help="a Hydra override of the run config (repeatable)")
    p.add_argument("--out", type=Path, required=True, help="where the records are kept")
    args = p.parse_args()
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", ["experiment=decision-real", "wandb.mode=disabled",
                                                     "progress=false",
                                                     f"experiment.output_len={args.output_len}",
                                                     *args.set]))
    e = cfg.experiment
    hardware, num_gpus = e.real_hardware, e.real_num_gpus
    point = point_cfg(cfg, e.real_models[0], hardware)
    link = load_link_preset(e.links[0])
    worker = CostModel(point.model, point.hardware, point.parallel, point.engine)
    service_s = isolated_s(worker, args.context_len, e.output_len)
    run_point = real_point(point, link, min(e.real_probe_s, 3 * service_s + 10.0))
    deps = {d.label: d for d in deployments(e, num_gpus, point.parallel.tp * point.parallel.pp, False)}
    if args.deployment not in deps:
        print(f"deployment: '{args.deployment}' is not one of {', '.join(deps)}", file=sys.stderr)
        return 2
    base = deps[args.deployment].apply(run_point)
    run_cfg, targets = length_point(e, base, CostModel(point.model, point.hardware, ParallelConfig(), point.engine),
                                   args.context_len, args.tbt_ms)
    smooth = get_smoothness("p99_tbt")
    run_cfg = replace_run(run_cfg if args.keep_slack else judged_run(run_cfg, smooth), workload=dataclasses.replace(run_cfg.workload, rate=args.rate,
                                                                num_requests=args.requests))
    requests = build_workload(run_cfg.workload, run_cfg.model.vocab_size, run_cfg.seed)
    apply_sampling(run_cfg, requests)
    runner = RealProbes(args.out)
    records = runner.records(run_cfg, requests)
    kept = args.out / runner.last_dir
    window = SteadyRule(e.span_factor, e.min_judged,
                        e.max_requests_per_gpu * max(e.num_gpus)).window(records)
    finished = sum(r.finished for r in records)
    verdict = ("unfinished" if finished < len(records) else "unjudged" if not window.judged
               else smooth.judge(window.judged, targets) or "pass")
    result = {"deployment": args.deployment, "context_len": args.context_len, "rate": args.rate,
              "num_requests": len(records), "num_finished": finished, "judged": len(window.judged),
              "steady": window.steady, "steady_reason": window.reason, "verdict": verdict,
              "ttft_slo_ms": targets.ttft_ms, "tbt_slo_ms": targets.tbt_ms, "records": str(kept)}
    (kept / "verdict.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    print(late_gaps_report(kept, targets.tbt_ms / 1e3, {r.request_id for r in window.judged}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
