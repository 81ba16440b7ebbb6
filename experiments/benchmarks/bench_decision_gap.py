"""Where the real engine's capacity gap to the simulator comes from:
one `experiment=decision-real` probe (tiny on this CPU, a colocated sarathi
deployment at L = 1K, Poisson arrivals at a fixed rate) run on the real engine
and, with the same requests, on the simulator priced by the cpu profile. Per
iteration, each worker's batches are rebuilt exactly from the records (the
requests a worker first scheduled at an iteration's start, their chunks in
arrival order, every running request decoding; an iteration whose slices do not
add up to its recorded prefill and decode tokens and KV read is left out) and
priced by the CostModel: measured / priced, chunk iterations and decode-only
ones apart, and the worker's time between iterations. Per request: TTFT and
the TBT gaps at the frontend against the same gaps at the worker (the ends of
the iterations that sampled them), so that a gap splits into step time, time
between steps and the event hop. The CPU each worker process got (utime +
stime over the run, from /proc) and its thread count say whether the cores
were oversubscribed.

    python experiments/benchmarks/bench_decision_gap.py [--rate 2.18] [--span-s 60] [--replicas 2]
        [--budget 512] [--torch-threads 1] [--runtime both|real|sim] [--out DIR]

`--rate` is requests/s of the whole deployment (2.18 on 2 workers is the rate
decision-real found failing p99 TBT). Figures: experiments/README.md,
"decision"; a timing run: under `flock` of a lock file the other timing jobs
share, on a shared machine."""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import json
import os
import threading
import time
from pathlib import Path

import numpy as np

L = 1024


def profile_engine(profile: str):
    """The testbed engine preset `testbed profile --out PROFILE` wrote beside the hardware one."""
    from testbed.profiling.profile import engine_path_for
    from testbed.sim.config import load_hardware_preset
    from testbed.sim.engine_config import load_engine_preset
    return load_engine_preset(str(engine_path_for(profile, load_hardware_preset(profile).name)))


def decision_point(rate: float, span_s: float, replicas: int, budget: int, torch_threads: int,
                   profile: str | None = None):
    """The decision-real probe's run config (decision_real.real_point of
    sarathi-`budget` at L) at `rate` for arrivals over ~span_s, and its SLO targets."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs
    from testbed.experiments.decision_real import real_point
    from testbed.experiments.decision_search import _workload, point_cfg
    from testbed.experiments.decision_slo import SLOTargets
    from testbed.experiments.deployments import Deployment, replace_run
    from testbed.model.config import CONF_DIR
    from testbed.sim.config import ParallelConfig, load_link_preset
    from testbed.sim.cost_model import CostModel
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", ["experiment=decision-real", "wandb.mode=disabled"]))
    e = cfg.experiment
    point = point_cfg(cfg, "tiny", "cpu")
    if profile:          # another `testbed profile` of this machine prices the steps (and the twin)
        from testbed.sim.config import load_hardware_preset
        point = replace_run(point, hardware=load_hardware_preset(profile), engine=profile_engine(profile))
    dep = Deployment(f"sarathi-{budget}", "colocated", "colocated", "sarathi", budget, replicas=replicas,
                     uses_link=False)
    run = dep.apply(real_point(point, load_link_preset(e.links[0]), e.real_probe_s))
    one_gpu = CostModel(point.model, point.hardware, ParallelConfig(), point.engine)
    targets = SLOTargets(e.ttft_k * one_gpu.iteration_time_s([(L, L)]) * 1e3,
                         float(e.tbt_slos_ms[0]))
    workload = dataclasses.replace(_workload(e, L), rate=rate, num_requests=max(2, int(rate * span_s)))
    run = replace_run(run, workload=workload, torch_threads=torch_threads,
                      slo=dataclasses.replace(run.slo, ttft_ms=targets.ttft_ms, tpot_ms=targets.tbt_ms))
    return run, targets


def requests_of(cfg):
    from testbed.runtime.build import apply_sampling
    from testbed.workloads.build import build_workload
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    return requests


class ProcSampler:
    """CPU seconds (utime + stime) and threads of this process's children,
    sampled every 0.2 s until stopped: the last sample of each is what it used."""

    def __init__(self):
        self.seen: dict[int, dict] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._tick = os.sysconf("SC_CLK_TCK")

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *_):
        self._stop.set()
        self._thread.join()

    def _children(self) -> list[int]:
        out = []
        for task in Path(f"/proc/{os.getpid()}/task").iterdir():
            with contextlib.suppress(OSError):
                out += [int(p) for p in (task / "children").read_text().split()]
        return out

    def _loop(self):
        while not self._stop.wait(0.2):
            for pid in self._children():
                with contextlib.suppress(OSError, ValueError, IndexError):
                    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                    cpu_s = (int(fields[11]) + int(fields[12])) / self._tick     # utime, stime
                    self.seen[pid] = {"cpu_s": cpu_s, "threads": int(fields[17]),
                                      "cmd": Path(f"/proc/{pid}/cmdline").read_bytes()[:80].decode(errors="replace")}


def rebuild(iterations, records, kv_bytes_per_token: int) -> list[tuple]:
    """(iteration, slices, ids of the requests it sampled a token for) for
    every iteration whose rebuilt batch matches its record; colocated sarathi
    without preemption (one that preempted does not match and is left out)."""
    first = {}
    for r in records:
        first.setdefault(r.first_scheduled_s, []).append(r)
    out, by_worker = [], {}
    for it in iterations:
        by_worker.setdefault(it.worker, []).append(it)
    for its in by_worker.values():
        its.sort(key=lambda it: it.start_s)
        prefilling, decoding = [], []          # [record, computed tokens], [record, output tokens so far]
        for it in its:
            prefilling += [[r, 0] for r in sorted(first.get(it.start_s, []), key=lambda r: r.arrival_s)]
            slices, left = [], it.num_prefill_tokens
            for entry in prefilling:
                if left == 0:
                    break
                n = min(left, entry[0].prompt_len - entry[1])
                entry[1] += n
                left -= n
                slices.append((n, entry[1]))
            slices += [(1, r.prompt_len + j) for r, j in decoding]
            ok = (left == 0 and len(decoding) == it.num_decode_tokens
                  and sum(c for _, c in slices) * kv_bytes_per_token == it.kv_bytes_read)
            done = [e for e in prefilling if e[1] == e[0].prompt_len]
            if ok:
                out.append((it, slices, [r.request_id for r, _ in decoding] + [e[0].request_id for e in done]))
            decoding = [[r, j + 1] for r, j in decoding if j + 1 < len(r.output_token_ids)]
            prefilling = [e for e in prefilling if e[1] < e[0].prompt_len]
            decoding += [[e[0], 1] for e in done if len(e[0].output_token_ids) > 1]
    return out


def pct(values, q) -> float | None:
    return None if len(values) == 0 else round(float(np.percentile(values, q)), 2)


def analyse(result, cfg, targets, label: str) -> dict:
    from testbed.experiments.decision_slo import P99TBT
    from testbed.sim.cost_model import CostModel
    from testbed.steady_state import SteadyRule
    cost = CostModel(cfg.model, cfg.hardware, cfg.parallel, cfg.engine)
    records = result.records
    iterations = result.iterations
    rebuilt = rebuild(iterations, records, cfg.model.kv_bytes_per_token)
    chunk = [(it.duration_s, cost.iteration_time_s(s)) for it, s, _ in rebuilt if it.num_prefill_tokens]
    decode = [(it.duration_s, cost.iteration_time_s(s)) for it, s, _ in rebuilt if not it.num_prefill_tokens]

    def ratio(rows):
        r = [m / p for m, p in rows]
        return {"n": len(rows), "measured_ms_p50": pct([m * 1e3 for m, _ in rows], 50),
                "priced_ms_p50": pct([p * 1e3 for _, p in rows], 50),
                "measured_over_priced_p10": pct(r, 10), "p50": pct(r, 50), "p90": pct(r, 90), "p99": pct(r, 99),
                "measured_ms_p99": pct([m * 1e3 for m, _ in rows], 99),
                "priced_ms_p99": pct([p * 1e3 for _, p in rows], 99),
                "measured_total_s": round(sum(m for m, _ in rows), 2), "priced_total_s": round(sum(p for _, p in rows), 2)}

    # the worker's time between iterations (its loop: polling, commands, events), per worker
    between = []
    by_worker = {}
    for it in iterations:
        by_worker.setdefault(it.worker, []).append(it)
    busy_s = {}
    for w, its in by_worker.items():
        its.sort(key=lambda it: it.start_s)
        busy_s[w] = sum(it.duration_s for it in its)
        between += [b.start_s - (a.start_s + a.duration_s) for a, b in zip(its, its[1:])
                    if b.start_s - (a.start_s + a.duration_s) < 0.05]     # back to back, not idle
    # frontend gaps against worker-side gaps: a token's worker time is the end of the
    # rebuilt iteration that sampled it (requests in an unmatched iteration are skipped)
    sampled_at: dict[str, list[float]] = {}
    for it, _, ids in rebuilt:
        for rid in ids:
            sampled_at.setdefault(rid, []).append(it.start_s + it.duration_s)
    hop, fe_gaps, w_gaps = [], [], []
    for r in records:
        wt = sampled_at.get(r.request_id, [])
        if len(r.token_times_s) < 2 or len(wt) != len(r.token_times_s):
            continue
        hop += [t - w for t, w in zip(r.token_times_s, wt)]
        fe_gaps += list(np.diff(r.token_times_s))
        w_gaps += list(np.diff(wt))
    rule = SteadyRule()
    window = rule.window(records)
    verdict = P99TBT().judge(window.judged, targets) if window.judged else "unjudged"
    judged_gaps = np.concatenate([np.diff(r.token_times_s) for r in window.judged if len(r.token_times_s) > 1]) \
        if window.judged else np.array([])
    ttft = [r.ttft_s for r in window.judged if r.ttft_s is not None]
    fe_ms, w_ms = np.asarray(fe_gaps) * 1e3, np.asarray(w_gaps) * 1e3
    over = fe_ms > targets.tbt_ms
    return {
        "label": label, "num_requests": len(records), "finished": sum(r.finished for r in records),
        "iterations": len(iterations), "rebuilt": len(rebuilt),
        "chunk_iterations": ratio(chunk), "decode_iterations": ratio(decode),
        "between_iterations_ms": {"p50": pct(np.asarray(between) * 1e3, 50),
                                  "p99": pct(np.asarray(between) * 1e3, 99), "total_s": round(sum(between), 2)},
        "worker_busy_s": {w: round(s, 2) for w, s in busy_s.items()},
        "hop_out_ms": {"p50": pct(np.asarray(hop) * 1e3, 50), "p99": pct(np.asarray(hop) * 1e3, 99)},
        "tbt_frontend_ms": {"p50": pct(fe_ms, 50), "p90": pct(fe_ms, 90), "p99": pct(fe_ms, 99)},
        "tbt_worker_ms": {"p50": pct(w_ms, 50), "p90": pct(w_ms, 90), "p99": pct(w_ms, 99)},
        "gaps_over_slo": int(over.sum()), "gaps": len(fe_ms),
        "gaps_over_slo_worker_side": int((w_ms > targets.tbt_ms).sum()),
        "judged": len(window.judged), "steady": window.steady,
        "judged_p99_tbt_ms": pct(judged_gaps * 1e3, 99), "judged_p99_ttft_ms": pct(np.asarray(ttft) * 1e3, 99),
        "ttft_slo_ms": round(targets.ttft_ms, 1), "tbt_slo_ms": targets.tbt_ms, "verdict": verdict or "pass"}


def run_real(cfg):
    from testbed.runtime.real import RealRuntime
    load0 = os.getloadavg()[0]
    r0 = os.times()
    with ProcSampler() as procs:
        t0 = time.monotonic()
        result = RealRuntime(cfg).run(requests_of(cfg))
        wall = time.monotonic() - t0
    r1 = os.times()
    workers = [p for p in procs.seen.values() if p["threads"] > 0]
    return result, {"wall_s": round(wall, 1), "serving_s": round(result.duration_s, 1),
                    "frontend_cpu_s": round((r1.user - r0.user) + (r1.system - r0.system), 1),
                    "children": [{"cpu_s": p["cpu_s"], "threads": p["threads"], "cmd": p["cmd"][:40]}
                                 for p in workers],
                    "load_1m_start": round(load0, 2), "load_1m_end": round(os.getloadavg()[0], 2)}


def run_sim(cfg):
    from testbed.runtime.sim import SimRuntime
    sim_cfg = dataclasses.replace(cfg, runtime=dataclasses.replace(cfg.runtime, name="sim"))
    return SimRuntime(sim_cfg, log=lambda *_: None).run(requests_of(sim_cfg)), sim_cfg


def sensitivity(scales: list[float], replicas: int, budget: int, profile: str | None = None) -> list[dict]:
    """The simulator's decision search (the study's own: decision_search.length_rows)
    for sarathi-`budget` on `replicas` workers at L, every step of the cpu
    profile scaled by s (calibration_scale and the overhead terms; the hops
    not): how far the capacity moves when the real steps are s x the profile's."""
    from testbed.experiments.decision_prober import Prober
    from testbed.experiments.decision_search import length_rows, point_cfg
    from testbed.experiments.decision_slo import get_smoothness
    from testbed.experiments.deployments import Deployment, replace_run
    from testbed.steady_state import SteadyRule
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf
    from testbed.config import register_configs
    from testbed.model.config import CONF_DIR
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", ["experiment=decision-real", "wandb.mode=disabled"]))
    e = cfg.experiment
    rule = SteadyRule(e.span_factor, e.min_judged,
                      e.max_requests_per_gpu * max(e.num_gpus))
    dep = Deployment(f"sarathi-{budget}", "colocated", "colocated", "sarathi", budget, replicas=replicas,
                     uses_link=False)
    out = []
    for s in scales:
        point = point_cfg(cfg, "tiny", "cpu")
        if profile:
            from testbed.sim.config import load_hardware_preset
            point = replace_run(point, hardware=load_hardware_preset(profile), engine=profile_engine(profile))
        h, g = point.hardware, point.run_engine()
        hw = dataclasses.replace(h, calibration_scale=h.calibration_scale * s,
                                 step_jitter_ms=[q * s for q in h.step_jitter_ms])
        engine = dataclasses.replace(g, overhead_ms=g.overhead_ms * s, overhead_per_seq_ms=g.overhead_per_seq_ms * s,
                                     overhead_per_token_ms=g.overhead_per_token_ms * s)
        point = replace_run(point, hardware=hw, engine=engine)
        rows, _ = length_rows(Prober(rule, lambda *_: None), e, point, dep, replicas, [point.link],
                              [get_smoothness(e.smoothness[0])], L, 2.0 * replicas, lambda *_: None)
        r = rows[0]
        out.append({"profile": profile or "cpu", "step_scale": s, "capacity_per_gpu": r["capacity_per_gpu"], "limited_by": r["limited_by"],
                    "steady": r["steady"], "probes": r["probes"]})
        print(json.dumps(out[-1]), flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rate", type=float, default=2.18, help="requests/s of the deployment")
    ap.add_argument("--span-s", type=float, default=60.0)
    ap.add_argument("--replicas", type=int, default=2)
    ap.add_argument("--budget", type=int, default=512)
    ap.add_argument("--torch-threads", type=int, default=1)
    ap.add_argument("--runtime", choices=("both", "real", "sim"), default="both")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--profile", default=None, help="a hardware YAML to price with instead of conf/hardware/cpu.yaml")
    ap.add_argument("--sensitivity", type=float, nargs="*", default=None,
                    help="instead: the simulator's capacity with every step scaled by each of these")
    args = ap.parse_args()
    if args.sensitivity:
        sensitivity(args.sensitivity, args.replicas, args.budget, args.profile)
        return
    cfg, targets = decision_point(args.rate, args.span_s, args.replicas, args.budget, args.torch_threads,
                                  args.profile)
    out = {"args": vars(args) | {"out": str(args.out)}, "num_requests": cfg.workload.num_requests}
    if args.runtime in ("both", "sim"):
        result, sim_cfg = run_sim(cfg)
        out["sim"] = analyse(result, sim_cfg, targets, "sim")
    if args.runtime in ("both", "real"):
        with contextlib.redirect_stdout(io.StringIO()):
            result, procs = run_real(cfg)
        out["real"] = analyse(result, cfg, targets, "real") | {"processes": procs}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        tag = f"_{Path(args.profile).stem}" if args.profile else ""
        name = f"gap_r{args.rate:g}_x{args.replicas}_c{args.budget}_t{args.torch_threads}_{args.runtime}{tag}.json"
        (args.out / name).write_text(text)


if __name__ == "__main__":
    main()
