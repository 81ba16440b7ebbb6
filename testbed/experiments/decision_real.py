"""The real engine's rows of `experiment=decision` (experiment.real=true):
for each of real_models on this CPU, the deployments of deployments.py on
real_num_gpus worker processes, at each of real_context_lens, found
by the same capacity search, SLOs and steady-state rule as the simulator's
rows (decision.py's Prober, search and length_rows), each probe a real run:
worker processes with torch_threads each, the KV of disaggregated
deployments over zmq on loopback shaped to the link's bandwidth. The rows
have source=real and the same columns, so each sits beside its simulated
twin (the same model, hardware, link, N, SLO, L and deployment; the
simulator priced by this CPU's profile, real_hardware). The
profile should be measured as the rows run: `testbed profile --workers N`
with N = real_num_gpus workers stepping at once (a step beside a
busy core takes longer than beside an idle one); a profile measured
otherwise is named in the log and the assumptions.

Real probes run on the wall clock, so they are bounded: a probe's arrivals
span at most real_probe_s, and a request still running three
service times (the twin's on the simulator) + 10 s, at most
real_probe_s, after the last arrival fails the probe as
unfinished; a probe that needs a longer span stays flagged (steady=false). Each search starts at the
simulator's capacity of its twin. Lengths run in increasing order, every
deployment at one L before the next L. A deployment is not probed (rows with
no capacity, steady=false, limited_by=probe_time) from the L on where a
steady probe at that start rate would need arrivals over more than
real_probe_s (the rule's size at the twin's longest service time on
the simulator); and once real_budget_s of wall time is spent, no
probe starts (a search it cuts keeps what it measured, flagged; later ones
are not probed; both limited_by=budget). Every real probe run keeps its
records (requests.jsonl, iterations.jsonl with each iteration's budget and
predicted duration, probe.json naming the point) under the study's
real_probes/NNN, named in decision_probes.csv's `records` column: why a
deployment missed an SLO is read there."""
from __future__ import annotations

import dataclasses
import json
import os
import time
from pathlib import Path

from testbed.config import RunConfig
from testbed.experiments.decision_prober import Prober
from testbed.experiments.decision_search import isolated_s, length_rows, point_cfg
from testbed.experiments.deployments import deployments, replace_run
from testbed.metrics import RequestRecord
from testbed.steady_state import SteadyRule

class RealProbes:
    """A probe run on the real engine: the deployment's worker processes started
    for it and stopped after it. No request finishing says nothing about
    memory here (the drain bound cut them all: the rate overloads), and a run
    the user interrupted (Ctrl-C) ends the study, not just the probe."""
    source = "real"
    none_finished_is_memory = False

    def __init__(self, record_root: Path | None = None):
        self.record_root = record_root          # None: records kept in memory only
        self.last_dir = ""                      # the last run's directory under record_root
        self._num_runs = 0

    def records(self, cfg: RunConfig, requests: list) -> list[RequestRecord]:
        from testbed.runtime.real import RealRuntime
        record_dir = None
        if self.record_root is not None:
            self._num_runs += 1
            self.last_dir = f"{self._num_runs:03d}"
            record_dir = self.record_root / self.last_dir
            record_dir.mkdir(parents=True, exist_ok=True)
            (record_dir / "probe.json").write_text(json.dumps(probe_point(cfg, len(requests)), indent=2))
        result = RealRuntime(cfg, record_dir=record_dir).run(requests)
        if result.interrupted:
            raise KeyboardInterrupt
        return result.records


def probe_point(cfg: RunConfig, num_requests: int) -> dict:
    """What a kept probe's records came from: the deployment, the workload and the link."""
    return {"mode": cfg.mode, "scheduler": cfg.scheduler, "token_budget": cfg.token_budget,
            "replicas": cfg.replicas, "prefill_workers": cfg.prefill_workers, "decode_workers": cfg.decode_workers,
            "prefill": dataclasses.asdict(cfg.prefill), "decode": dataclasses.asdict(cfg.decode),
            "model": cfg.model.name, "hardware": cfg.hardware.name, "link": cfg.link.name,
            "rate": cfg.workload.rate, "num_requests": num_requests, "workload": dataclasses.asdict(cfg.workload),
            "slo": dataclasses.asdict(cfg.slo), "adaptive": cfg.adaptive and dataclasses.asdict(cfg.adaptive),
            "timeout_s": cfg.timeout_s, "torch_threads": cfg.torch_threads}


def check_real(e) -> None:
    """The real rows need their simulated twins in the grid."""
    missing = [m for m in e.real_models if m not in e.models]
    if missing:
        raise ValueError(f"experiment.real_models: {missing} not in experiment.models={list(e.models)}; the real "
                         f"rows are compared with the simulator's rows of the same model (add them to models)")
    if e.real_hardware not in e.hardware:
        raise ValueError(f"experiment.hardware: the real rows run on this CPU, priced by "
                         f"experiment.real_hardware='{e.real_hardware}'; add it to "
                         f"experiment.hardware={list(e.hardware)} (the simulator's twin rows) or set "
                         f"experiment.real=false")
    if e.real_num_gpus not in e.num_gpus:
        raise ValueError(f"experiment.real_num_gpus: {e.real_num_gpus} is not in "
                         f"experiment.num_gpus={list(e.num_gpus)}")
    extra = sorted(set(e.real_context_lens) - set(e.context_lens))
    if extra:
        raise ValueError(f"experiment.real_context_lens: {extra} not in experiment.context_lens; the simulator's "
                         f"twin rows need them")


def real_point(point: RunConfig, link, drain_s: float) -> RunConfig:
    """The simulator's point run on the real engine: the KV shaped to the link;
    a request unfinished drain_s after the last arrival fails (timeout_s). A
    worker may be silent for drain_s too (runtime.hang_timeout_s, at least its
    own): a step that computes says so (runtime/step_watch.py), but a worker
    waiting without computing (a prefill worker's KV held up by a slow link)
    may wait as long as a request may drain."""
    import dataclasses
    transfer = dataclasses.replace(point.transfer, transport="shaped", shaped_inner="zmq",
                                   rate_gbps=link.bandwidth_gbps, latency_ms=link.latency_us / 1e3)
    runtime = dataclasses.replace(point.runtime, name="real",
                                  hang_timeout_s=max(point.runtime.hang_timeout_s, drain_s))
    return replace_run(point, runtime=runtime, link=link, transfer=transfer, timeout_s=drain_s, launcher="local")


def real_rows(cfg: RunConfig, sim_rows: list[dict], sim_service_s: dict, smooths: list, links: list,
              rule: SteadyRule, log, record_root: Path | None = None) -> tuple[list[dict], Prober, dict]:
    """(the real rows, their Prober, the assumptions they ran under). The
    first probe of each search is sized from its twin's last longest service
    time on the simulator (`sim_service_s`, the simulator's Prober's), and a
    short one is re-run longer once at most: each run is a minute here."""
    from testbed.sim.config import load_hardware_preset
    from testbed.sim.cost_model import CostModel
    e = cfg.experiment
    num_gpus, hardware = e.real_num_gpus, e.real_hardware
    profile = load_hardware_preset(hardware)
    profile_note = profile_conditions(profile, num_gpus, cfg.torch_threads)
    if profile_note:
        log(f"decision real: {profile_note}")
    started, load_start = time.monotonic(), os.getloadavg()[0]
    prober = Prober(rule, log, RealProbes(record_root), max_span_s=e.real_probe_s, max_lengthenings=1,
                    deadline=started + e.real_budget_s)
    prober.service_s.update(sim_service_s)          # the same keys: (model, hardware, N, deployment, link, L, tbt)
    twin = {(r["model"], r["link"], r["deployment"], r["context_len"]): r["capacity_per_gpu"] for r in sim_rows
            if r["hardware"] == hardware and r["num_gpus"] == num_gpus and r["slo"] == smooths[0].name
            and r["tbt_slo_ms"] == e.tbt_slos_ms[0]}
    rows = []
    for model_name in e.real_models:
        point = point_cfg(cfg, model_name, hardware)
        worker = CostModel(point.model, point.hardware, point.parallel, point.engine)
        stopped: dict[tuple, str] = {}
        for L in sorted(e.real_context_lens):
            for dep in deployments(e, num_gpus, point.parallel.tp * point.parallel.pp, e.reuse > 0):
                for link in (links if dep.uses_link else links[:1]):
                    key = (model_name, hardware, num_gpus, dep.label, link.name if dep.uses_link else "-", L,
                           e.tbt_slos_ms[0] if dep.reads_slo else "-")
                    service_s = sim_service_s.get(key) or isolated_s(worker, L, e.output_len)
                    # a passing probe drains within about one service time; an overloaded one is cut
                    # at three (it fails either way: unfinished instead of late)
                    run_point = real_point(point, link, min(e.real_probe_s, 3 * service_s + 10.0))
                    gpus = dep.num_gpus(run_point)
                    where = (dep.label, link.name)
                    if where not in stopped and time.monotonic() - started > e.real_budget_s:
                        stopped[where] = "budget"
                    sim_cap = twin.get((model_name, link.name, dep.label, L))
                    start = sim_cap * gpus if sim_cap else gpus / (2 * service_s)
                    # a steady probe at the expected rate would outlast the bound: not run at all
                    if where not in stopped and rule.num_requests(start, service_s) / start > e.real_probe_s:
                        stopped[where] = "probe_time"
                    new, _ = length_rows(prober, e, run_point, dep, num_gpus, links if not dep.uses_link else [link],
                                         smooths, L, start, log, e.real_rel_tol, e.real_max_probes,
                                         skip=stopped.get(where))
                    rows += new
    assumptions = {
        "models": list(e.real_models), "hardware": hardware, "num_gpus": num_gpus,
        "context_lens": sorted(e.real_context_lens), "workers": "one process per GPU, torch_threads="
        f"{cfg.torch_threads}, launcher=local", "kv_transfer": "zmq on loopback shaped to the link (transport=shaped)",
        "probe_s": e.real_probe_s, "budget_s": e.real_budget_s, "rel_tol": e.real_rel_tol,
        "max_probes": e.real_max_probes, "start": "the simulator's capacity of the twin row",
        "cpu_count": os.cpu_count(), "load_1m_start": round(load_start, 2),
        "load_1m_end": round(os.getloadavg()[0], 2), "elapsed_s": round(time.monotonic() - started, 1),
        "num_probe_runs": prober.num_runs,
        "profile": {"profiled_workers": profile.profiled_workers, "profiled_threads": profile.profiled_threads,
                    "note": profile_note or "as the rows run"}}
    return rows, prober, assumptions


def profile_conditions(hw, num_workers: int, torch_threads: int) -> str:
    """"" when the profile `hw` was measured as the real rows run (num_workers
    workers stepping at once, torch_threads each), else what differs and the fix."""
    if (hw.profiled_workers, hw.profiled_threads) == (num_workers, torch_threads):
        return ""
    seen = "not recorded" if not hw.profiled_workers else \
        f"{hw.profiled_workers} worker(s) stepping at once, {hw.profiled_threads} torch thread(s) each"
    return (f"hardware '{hw.name}' was profiled with {seen}; the real rows run {num_workers} workers with "
            f"torch_threads={torch_threads}, so the simulated twins price steps measured otherwise "
            f"(re-measure: testbed profile --workers {num_workers} --threads {torch_threads} "
            f"--out conf/hardware/{hw.name}-{num_workers}w.yaml, then experiment.hardware=[...] and "
            f"experiment.real_hardware={hw.name}-{num_workers}w)")
