"""The short soak: records stream to the run directory while a run goes, and
nothing per request stays behind in the frontend when it ends.

A few hundred requests through the real runtime (tiny model, mode=disagg 1P1D
over zmq): none lost, no KV block leaked, requests.jsonl has lines while
requests are still in flight, and at the end every per-request map of the
controller, the record log and the event gate is empty (the gate keeps only
requests that ended within its grace). The simulator pulls a lazy workload
and writes the same files as from a list. RSS is not asserted here (noisy on
a shared machine): experiments/benchmarks/bench_soak.py measures the slopes.
"""
from __future__ import annotations

import time

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.config import RunConfig, register_configs
from testbed.metrics import IterationRecord, RequestRecord, read_requests
from testbed.model.config import CONF_DIR
from testbed.record_log import RecordLog
from testbed.runtime.build import sampled
from testbed.runtime.event_gate import EventGate
from testbed.runtime.messages import Add, RequestMsg
from testbed.run_stats import RunStats
from testbed.workloads.build import build_workload, iter_workload

NUM_REQUESTS = 200


def config(*overrides: str) -> RunConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", ["wandb.mode=disabled", "progress=false", *overrides]))


def soak_config(*overrides: str) -> RunConfig:
    return config("runtime=real", "mode=disagg", "transfer.transport=zmq", "timeout_s=120", "workload=mixed",
                  f"workload.num_requests={NUM_REQUESTS}", "workload.arrival=poisson", "workload.rate=50",
                  "workload.prompt_dist=uniform", "workload.prompt_min=8", "workload.prompt_max=24",
                  "workload.output_dist=uniform", "workload.output_min=2", "workload.output_max=3", *overrides)


def per_request_state(rt) -> dict[str, int]:
    ctl = rt.controller
    return {"records": len(ctl.records), "arrival_index": len(ctl.arrival_index), "location": len(ctl.location),
            "unresolved": len(ctl.unresolved), "early_tokens": len(ctl.early_tokens),
            "early_finish": len(ctl.early_finish), "handoffs": len(ctl.handoffs), "prefilling": len(ctl.prefilling),
            "queue": len(ctl.queue), "record_log.waiting": len(rt.records.waiting)}


def test_short_soak_streams_records_and_leaves_no_per_request_state(tmp_path):
    from testbed.runtime.real import RealRuntime
    cfg = soak_config()
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    for r in requests:
        sampled(cfg, r)
    seen_in_flight = []           # (lines on disk, requests still unresolved), read while the run goes
    next_look = [0.0]

    def look(rt, ev) -> None:
        if time.monotonic() >= next_look[0] and rt.controller.unresolved:
            next_look[0] = time.monotonic() + 0.25
            with open(tmp_path / "requests.jsonl") as f:
                seen_in_flight.append((sum(1 for _ in f), len(rt.controller.unresolved)))

    rt = RealRuntime(cfg, on_event=look, record_dir=tmp_path)
    result = rt.run(requests)

    records = read_requests(tmp_path / "requests.jsonl")
    assert [r.request_id for r in records] == [r.request_id for r in requests]      # arrival order
    assert [r.status for r in records] == ["finished"] * NUM_REQUESTS                   # none lost
    assert all(s["all_free"] and s["num_free_blocks"] == s["num_blocks"] for s in result.worker_stats.values())
    assert set(result.worker_stats) == {"prefill0", "decode0"}
    # the file grew while requests were still in flight, not only at the end
    assert any(lines > 0 and unresolved > 0 for lines, unresolved in seen_in_flight), seen_in_flight
    assert per_request_state(rt) == dict.fromkeys(per_request_state(rt), 0)
    # the gate forgets a request grace_s after it ended: what it still holds ended within that
    gate = rt.gate
    assert set(gate.sent_to) <= {rid for _, rid in gate.retired}
    assert len(gate.retired) <= NUM_REQUESTS and gate.retired[-1][0] - gate.retired[0][0] <= gate.grace_s
    summary = result.log.summary(result.duration_s)
    assert summary["num_finished"] == NUM_REQUESTS and summary["kv_transfer"]["num_transfers"] == NUM_REQUESTS


def test_the_simulator_pulls_a_lazy_workload_and_writes_what_a_list_gives(tmp_path):
    from testbed.runtime.sim import SimRuntime
    cfg = config("runtime=sim", "mode=disagg", "model=llama3-8b", "hardware=h100-sxm", "link=rdma-400",
                 "workload=mixed", "workload.num_requests=300", "workload.rate=50")
    listed = SimRuntime(cfg, record_dir=tmp_path / "list").run(build_workload(cfg.workload, cfg.model.vocab_size,
                                                                              cfg.seed))
    rt = SimRuntime(cfg, record_dir=tmp_path / "lazy")
    lazy = rt.run(iter_workload(cfg.workload, cfg.model.vocab_size, cfg.seed))
    for name in ("requests.jsonl", "iterations.jsonl"):
        assert (tmp_path / "list" / name).read_text() == (tmp_path / "lazy" / name).read_text()
    assert lazy.log.summary(lazy.duration_s) == listed.log.summary(listed.duration_s)
    assert lazy.log.summary()["num_finished"] == 300
    assert per_request_state(rt) == dict.fromkeys(per_request_state(rt), 0)


def test_a_lazy_workload_out_of_arrival_order_is_refused():
    from testbed.runtime.sim import SimRuntime
    cfg = config("runtime=sim", "workload=mixed", "workload.num_requests=3")
    late_first = reversed(build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed))
    with pytest.raises(ValueError, match=r"request r1 arrives at .* before the one yielded before it .*arrival order"):
        SimRuntime(cfg).run(late_first)


def record(rid: str, arrival_s: float, times: list[float]) -> RequestRecord:
    return RequestRecord(rid, "finished", 4, list(range(len(times))), arrival_s, arrival_s, times[0], times,
                         times[-1])


def test_record_log_writes_in_arrival_order_holding_only_what_ended_early(tmp_path):
    log = RecordLog(RunStats(None, None), tmp_path, chunk=1, flush_s=60.0)
    a, b, c = record("a", 0.0, [0.1, 0.2]), record("b", 0.5, [0.6, 0.7, 0.9]), record("c", 0.6, [0.8])
    log.request(c, 2)
    log.request(b, 1)
    assert sorted(log.waiting) == [1, 2] and (tmp_path / "requests.jsonl").read_text() == ""
    log.request(a, 0)                       # the first arrival ends: all three go, in arrival order
    log.iteration(IterationRecord(0.0, 0.1, 4, 0))
    assert log.waiting == {}
    assert [line.split('"request_id": "')[1][0] for line in (tmp_path / "requests.jsonl").read_text().splitlines()] \
        == ["a", "b", "c"]                  # on disk before close (chunk=1)
    assert log.requests() == [a, b, c]
    s = log.summary()
    assert s["num_finished"] == 3 and s["tbt_ms"]["max"] == pytest.approx(200.0)
    assert s["tbt_ms"]["p50"] == pytest.approx(100.0) and s["iterations"]["num_iterations"] == 1


def test_without_a_run_directory_the_records_stay_in_memory():
    log = RecordLog(RunStats(None, None), chunk=1)
    a = record("a", 0.0, [0.1])
    log.request(a, 0)
    log.iteration(IterationRecord(0.0, 0.1, 4, 0))
    assert log.in_memory and log.dir is None
    assert log.requests() == [a] and log.requests()[0] is a      # the controller's own objects, never re-parsed
    assert log.iterations() == [IterationRecord(0.0, 0.1, 4, 0)]
    assert log.summary()["num_finished"] == 1


def test_past_memory_iterations_the_records_spill_to_a_temporary_directory_removed_with_the_log():
    log = RecordLog(RunStats(None, None), chunk=1, memory_iterations=3)
    a, b = record("a", 0.0, [0.1]), record("b", 0.5, [0.6, 0.7])
    log.request(a, 0)
    its = [IterationRecord(float(i), 0.1, 4, 0) for i in range(5)]
    for it in its[:3]:
        log.iteration(it)
    assert log.in_memory                                # 3 is not past the bound
    log.iteration(its[3])
    where = log.dir
    assert not log.in_memory and where.is_dir()
    assert len((where / "iterations.jsonl").read_text().splitlines()) == 4     # what was in memory went first
    log.iteration(its[4])
    log.request(b, 1)
    assert log.requests() == [a, b] and log.iterations() == its
    assert list(log.iter_requests()) == [a, b] and list(log.iter_iterations()) == its
    del log
    assert not where.exists()


@pytest.mark.parametrize("case", ["colocated_preempting", "disagg_seats", "kvstore_1p2d"])
def test_a_simulated_run_gives_the_same_records_in_memory_as_through_its_files(case, tmp_path):
    """A capacity probe's records (no run directory: kept in memory) against the same
    run's records parsed back from requests.jsonl and iterations.jsonl."""
    import sys
    from pathlib import Path
    from testbed.runtime.sim import SimRuntime
    sys.path.insert(0, str(Path(__file__).parent))
    from test_sim_fast_forward import BASE, CASES, CHAT
    cfg = config(*BASE, *CHAT, *CASES[case])
    requests = list(build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed))
    kept = SimRuntime(cfg, log=lambda line: None).run([sampled(cfg, r) for r in requests])
    written = SimRuntime(cfg, log=lambda line: None, record_dir=tmp_path).run([sampled(cfg, r) for r in requests])
    assert kept.log.in_memory and not written.log.in_memory
    assert kept.records == written.records and kept.iterations == written.iterations
    assert len(kept.records) == len(requests) and all(r.finished for r in kept.records)
    assert len(kept.iterations) > len(requests)
    assert kept.log.summary() == written.log.summary()


def test_the_event_gate_forgets_a_request_grace_s_after_it_ended():
    gate = EventGate(["w0"], grace_s=5.0)
    for i in range(3):
        gate.on_command("w0", Add(RequestMsg(f"r{i}", [1, 2], 4, 0.0, 0.0, 1.0, 0, True, None)))
    gate.retire("r0", 100.0)
    gate.retire("r1", 103.0)
    assert set(gate.sent_to) == {"r0", "r1", "r2"}        # late events of r0 and r1 still pass
    gate.retire("r2", 105.5)                               # r0 ended 5.5 s ago: forgotten
    assert set(gate.sent_to) == {"r1", "r2"} and [rid for _, rid in gate.retired] == ["r1", "r2"]
