"""runtime.sim_processes (testbed/runtime/sim_split.py, testbed/record_part.py):
a colocated round-robin run simulated as groups of replicas in child
processes, their records merged. It must change nothing but the wall time:
requests.jsonl, iterations.jsonl and summary.json are byte for byte those of
the one-process run, on workloads that reuse prefixes, preempt, fail
requests at arrival, jitter each worker's steps and plan budgets (adaptive);
with groups of unequal size, and with merge windows small enough to cut
through ties. A run it does not apply to says why and runs in one process; a
part that fails or dies stops the run, named, and leaves nothing behind."""
import os
import signal
from pathlib import Path

import numpy as np
import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

import testbed.record_part as record_part
from testbed.config import RunConfig, register_configs, validate
from testbed.metrics import IterationRecord, RequestRecord, iter_iterations, iter_requests
from testbed.model.config import CONF_DIR
from testbed.run import execute
from testbed.run_stats import RunStats
from testbed.runtime.build import sampled
from testbed.runtime.sim_split import run_split, split_groups
from testbed.workloads.build import iter_workload

# the GPU preset's timing without a frontend hop (the split's condition), on the tiny model;
# a jitter table makes the times differ unless each worker keeps its own draws in order
BASE = ["runtime=sim", "model=tiny", "hardware=h100-sxm", "hardware.profiled_for=h100-sxm",
        "hardware.frontend_hop_ms=0", "hardware.frontend_message_ms=0", "num_kv_blocks=2000",
        "hardware.step_jitter_ms=[-0.02,0.0,0.01,0.05,0.4]", "enable_prefix_caching=true", "scheduler=sarathi",
        "token_budget=256", "mode=colocated", "slo.ttft_ms=40", "slo.tpot_ms=5"]
# conversations (prefix hits) whose turns arrive while others decode, across 16-token blocks
CHAT = ["workload=multiturn", "workload.num_requests=60", "workload.rate=60", "workload.think_time_s=0.02",
        "workload.output_min=8", "workload.output_max=80"]
CASES = {
    "four_replicas": ["replicas=4", *CHAT],
    # little memory: preemptions, and the longest conversations' turns fail at arrival (no pick)
    "tight_cache": ["replicas=3", "num_kv_blocks=40", *CHAT],
    "adaptive": ["replicas=4", "scheduler=adaptive", *CHAT],
    # no jitter, equal requests arriving together: the replicas step in lockstep, and iterations of
    # different parts end at the same instants (ties go in worker order)
    "lockstep": ["replicas=4", "hardware.step_jitter_ms=[]", "workload=mixed", "workload.num_requests=40",
                 "workload.arrival=burst", "workload.prompt_dist=fixed", "workload.prompt_len=100",
                 "workload.output_dist=fixed", "workload.output_len=30"],
}
FILES = ("requests.jsonl", "iterations.jsonl", "summary.json")


def config(*overrides: str) -> RunConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", ["wandb.mode=disabled", "progress=false", *overrides]))


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_split_run_writes_the_one_process_run_byte_for_byte(case, tmp_path, capsys, monkeypatch):
    one = execute(config(*BASE, *CASES[case]), tmp_path / "one")
    monkeypatch.setattr(record_part, "WINDOW", 7)       # many merge windows, some ending inside a tie
    for processes in (2, 3):
        cfg = config(*BASE, *CASES[case], f"runtime.sim_processes={processes}")
        out = tmp_path / f"split{processes}"
        groups, _ = split_groups(cfg, out)
        assert groups is not None and len(groups) == processes
        capsys.readouterr()
        execute(cfg, out)
        assert "one process" not in capsys.readouterr().err
        for name in FILES:
            assert (out / name).read_bytes() == (tmp_path / "one" / name).read_bytes(), (case, processes, name)
        assert not list(out.glob(".sim-parts-*")), "the parts' directory was left behind"
    # what the comparison covered
    iterations = list(iter_iterations(tmp_path / "one" / "iterations.jsonl"))
    workers = {it.worker for it in iterations}
    assert len(workers) == len(groups[0]) + len(groups[1]) + len(groups[2])
    if case == "lockstep":
        ends = [it.start_s + it.duration_s for it in iterations]
        assert len(set(ends)) * 4 <= len(ends), "the replicas did not step together"
    if case == "tight_cache":
        assert one["num_failed"] > 0 and one["num_preemptions"] > 0 and one["first_error"]["failed"]
    if case == "adaptive":
        assert one["iterations"]["prefill_budget"]["max"] > 0 and one["iterations"]["predictor_error"]
    assert one["num_finished"] >= 30 and one["fluidity_index"] is not None


def test_runs_the_split_does_not_apply_to_say_why_and_run_in_one_process(tmp_path, capsys):
    for overrides, why in ((["mode=disagg", "prefill_workers=1", "decode_workers=1", "link=rdma-400"], "mode=disagg"),
                           (["replicas=2", "router=least_outstanding"], "router=least_outstanding"),
                           (["replicas=2", "hardware.frontend_hop_ms=0.5"], "frontend hop"),
                           (["replicas=1"], "nothing to split")):
        cfg = config(*BASE, *CHAT, "workload.num_requests=6", *overrides, "runtime.sim_processes=2")
        summary = execute(cfg, tmp_path / why.replace(" ", "_"))
        err = capsys.readouterr().err
        assert "runtime.sim_processes=2: simulating in one process" in err and why in err, err
        assert summary["num_finished"] == summary["num_requests"] > 0


def test_sim_processes_below_one_or_not_a_count_is_refused_naming_the_field():
    for bad in (0, -2, "many"):
        with pytest.raises(ValueError, match=r"runtime.sim_processes: must be an integer >= 1 or auto"):
            validate(config(*BASE, f"runtime.sim_processes={bad}"))


def test_auto_takes_one_process_per_cpu_this_process_may_use_at_most_one_per_replica(tmp_path):
    cpus = len(os.sched_getaffinity(0))
    for replicas in (2, 8):
        cfg = config(*BASE, f"replicas={replicas}", "runtime.sim_processes=auto")
        validate(cfg)
        groups, why = split_groups(cfg, tmp_path)
        if cpus == 1:
            assert groups is None and "auto is one process" in why
        else:
            assert len(groups) == min(cpus, replicas)
            assert sorted(w for g in groups for w in g) == sorted(f"replica{i}" for i in range(replicas))


def _requests(cfg: RunConfig):
    return (sampled(cfg, r) for r in iter_workload(cfg.workload, cfg.model.vocab_size, cfg.seed))


def test_a_part_whose_workload_fails_stops_the_run_with_its_traceback(tmp_path):
    cfg = config(*BASE, *CHAT, "replicas=2", "runtime.sim_processes=2")

    def broken():
        for k, req in enumerate(_requests(cfg)):
            if k == 20:
                raise ValueError("request 20 is malformed")
            yield req
    with pytest.raises(RuntimeError, match=r"(?s)simulation part \d failed:.*request 20 is malformed"):
        run_split(cfg, broken(), tmp_path, split_groups(cfg, tmp_path)[0])
    assert not list(tmp_path.glob(".sim-parts-*"))


def test_a_part_killed_mid_run_stops_the_run_naming_it(tmp_path):
    cfg = config(*BASE, *CHAT, "replicas=2", "runtime.sim_processes=2")
    parent = os.getpid()

    def killing_part_1():
        import multiprocessing
        for k, req in enumerate(_requests(cfg)):
            if k == 30 and os.getpid() != parent and multiprocessing.current_process().name == "sim-part-1":
                os.kill(os.getpid(), signal.SIGKILL)
            yield req
    with pytest.raises(RuntimeError, match=r"simulation part 1 died \(exit code -9\)"):
        run_split(cfg, killing_part_1(), tmp_path, split_groups(cfg, tmp_path)[0])
    assert not list(tmp_path.glob(".sim-parts-*"))


def _request(k: int, rng: np.random.Generator) -> RequestRecord:
    status = ("finished", "finished", "finished", "failed", "aborted")[k % 5]
    done = status == "finished"
    times = sorted(rng.uniform(k, k + 1, int(rng.integers(1, 6))).tolist()) if done else []
    return RequestRecord(request_id=f"r{k}", status=status, prompt_len=int(rng.integers(1, 500)),
                         output_token_ids=list(range(len(times))), arrival_s=k - 0.5,
                         first_scheduled_s=k - 0.25 if done else None, first_token_s=times[0] if times else None,
                         token_times_s=times, finish_s=times[-1] if done else k + 0.1,
                         num_preemptions=int(rng.integers(0, 2)), error=None if done else f"{status} #{k}")


def _iteration(k: int, rng: np.random.Generator) -> IterationRecord:
    return IterationRecord(k * 0.01, float(rng.uniform(0.001, 0.01)), int(rng.integers(0, 2)) * 64,
                           int(rng.integers(0, 9)), int(rng.integers(0, 10**6)), "w",
                           None if k % 3 == 0 else 256, None if k % 4 == 0 else float(rng.uniform(0.001, 0.01)))


def test_merged_run_stats_summarize_as_one_fed_in_order():
    """Requests and iterations dealt to three parts at random places: the
    merged state's summary equals the one-piece state's, float for float
    (means sum in the same order, first errors are the run's first)."""
    rng = np.random.default_rng(7)
    requests = [_request(k, rng) for k in range(200)]
    iterations = [_iteration(k, rng) for k in range(500)]
    whole = RunStats(40.0, 5.0)
    for r in requests:
        whole.add_request(r)
    whole.add_iterations(iterations)
    request_owner, iteration_owner = rng.integers(0, 3, len(requests)), rng.integers(0, 3, len(iterations))
    request_owner[:5] = 2                      # the first failure and abort are in the last part
    parts, request_places, iteration_places = [], [], []
    for part in range(3):
        stats = RunStats(40.0, 5.0)
        places = np.flatnonzero(request_owner == part)
        for k in places:
            stats.add_request(requests[k])
        its = np.flatnonzero(iteration_owner == part)
        stats.add_iterations([iterations[k] for k in its])
        parts.append(stats)
        request_places.append(places)
        iteration_places.append(its)
    merged = RunStats.merged(parts, request_places, iteration_places)
    assert merged.summary() == whole.summary()
    assert merged.summary()["first_error"] == {"failed": "failed #3", "aborted": "aborted #4"}
