"""runtime=sim's fast-forward (runtime.sim_fast_forward, testbed/runtime/sim.py):
a worker that nothing can reach before its iteration ends runs its next
iterations at once, steady decode batches on their short path. It must change
nothing but the simulator's own speed: requests.jsonl, iterations.jsonl and
summary.json are byte for byte those of the plain event loop, on workloads
where requests arrive while others decode, finish, cross block boundaries,
reuse cached prefixes and (with little memory) preempt each other, with step
jitter on; colocated, disaggregated 1P2D (and 1P1D with two seats) and kvstore. And the cost
executor's decode path gives execute()'s figures for the same batch."""
import dataclasses
import json
import random
from pathlib import Path

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.config import RunConfig, register_configs
from testbed.executor import Executor
from testbed.model.config import CONF_DIR, load_model_preset
from testbed.modes.routers import RoundRobin, Router
from testbed.request import Request
from testbed.runtime.build import sampled
from testbed.runtime.sim import SimRuntime
from testbed.runtime.sim_decode_run import decode_run, steady_step
from testbed.sim.config import load_hardware_preset
from testbed.sim.engine_config import EngineConfig
from testbed.sim.cost_executor import CostModelExecutor
from testbed.sim.cost_model import CostModel
from testbed.sim.jitter import StepJitter
from testbed.workloads.build import iter_workload

# h100-sxm with no frontend hop (the fast path's condition) and a jitter table, which makes the
# times differ unless each worker's draws stay in order. profiled_for=h100-sxm keeps these measured
# fields (and the CPU preset's other ones: an odd machine, but only on-equals-off matters here)
BASE = ["runtime=sim", "model=tiny", "hardware=h100-sxm", "hardware.profiled_for=h100-sxm",
        "hardware.frontend_hop_ms=0", "hardware.frontend_message_ms=0",
        "hardware.step_jitter_ms=[-0.02,0.0,0.01,0.05,0.4]", "enable_prefix_caching=true", "scheduler=sarathi",
        "token_budget=256"]
# conversations: each turn reuses the previous prompt (prefix hits), outputs of 8..80 tokens
# cross 16-token blocks, and turns arrive while other requests decode
NUM_REQUESTS = 32
CHAT = ["workload=multiturn", f"workload.num_requests={NUM_REQUESTS}", "workload.rate=40",
        "workload.think_time_s=0.02", "workload.output_min=8", "workload.output_max=80"]
CASES = {
    "colocated": ["mode=colocated", "replicas=3"],
    "colocated_preempting": ["mode=colocated", "replicas=2", "num_kv_blocks=56"],
    "disagg_1p2d": ["mode=disagg", "prefill_workers=1", "decode_workers=2", "link=rdma-400"],
    # KV landing while both seats of the one decode worker are taken: it waits for a seat
    "disagg_seats": ["mode=disagg", "prefill_workers=1", "decode_workers=1", "link=rdma-400", "max_num_seqs=2"],
    "kvstore_1p2d": ["mode=kvstore", "prefill_workers=1", "decode_workers=2", "link=rdma-400"],
    # the cache-aware router over two prefill workers, a store of 40 blocks (evictions) and a disk
    # tier of 40 more (demotions, reads back); and early rejection refusing some arrivals
    "kvstore_2p2d_small_store": ["mode=kvstore", "prefill_workers=2", "decode_workers=2", "link=rdma-400",
                                 "kvstore.capacity_bytes=1310720", "kvstore.disk_capacity_bytes=1310720",
                                 "kvstore.disk_path=/nonexistent-unused-on-sim"],
    # (by predicted TTFT and by the decode pool's free blocks: a third of the requests)
    "kvstore_rejecting": ["mode=kvstore", "prefill_workers=2", "decode_workers=2", "link=rdma-400",
                          "kvstore.early_rejection=true", "slo.ttft_ms=12", "num_kv_blocks=48"],
    # whole prefills, as the decision and capacity studies run disagg: vllm_v0's steady decodes
    "colocated_vllm_v0": ["mode=colocated", "replicas=2", "scheduler=vllm_v0"],
    # adaptive plans and observes every batch: its steady decodes too (observe_steady), in order
    "colocated_adaptive": ["mode=colocated", "replicas=2", "scheduler=adaptive"],
    "colocated_adaptive_arrivals": ["mode=colocated", "replicas=2", "scheduler=adaptive",
                                    "adaptive.rollout_arrivals=true"],
    # a router that reads the pool: no replica runs past the next arrival (round_robin's plan does)
    "colocated_least_outstanding": ["mode=colocated", "replicas=3", "router=least_outstanding"],
    "disagg_vllm_v0": ["mode=disagg", "prefill_workers=1", "decode_workers=2", "link=rdma-400",
                       "scheduler=vllm_v0"],
    # decode workers short of blocks: reservations rejected and queued, so decode runs stop and start
    "disagg_tight": ["mode=disagg", "prefill_workers=1", "decode_workers=3", "link=rdma-400", "scheduler=vllm_v0",
                     "num_kv_blocks=56"],
}


def config(*overrides: str) -> RunConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", ["wandb.mode=disabled", "progress=false", *overrides]))


def test_a_replica_runs_past_the_arrivals_round_robin_sends_to_the_others(tmp_path, monkeypatch):
    """With round_robin's plan (Router.planned) a colocated replica decodes on
    past the arrivals planned for the others, in longer DecodeRuns; without it
    each stops at every arrival. The same run either way."""
    planned, planned_summary = _run(tmp_path / "planned", *CASES["colocated"])
    monkeypatch.setattr(RoundRobin, "planned", Router.planned)
    unplanned, unplanned_summary = _run(tmp_path / "unplanned", *CASES["colocated"])
    for name in ("requests.jsonl", "iterations.jsonl"):
        assert (tmp_path / "planned" / name).read_bytes() == (tmp_path / "unplanned" / name).read_bytes(), name
    assert json.dumps(planned_summary) == json.dumps(unplanned_summary)
    assert planned.num_in_runs > unplanned.num_in_runs


def iterations_of(run_dir: Path) -> int:
    return sum(1 for _ in open(run_dir / "iterations.jsonl"))


def _run(tmp: Path, *overrides: str) -> tuple[SimRuntime, dict]:
    """The run and summary.json's figures (testbed/run.py's execute, less the config echo)."""
    cfg = config(*BASE, *CHAT, *overrides)
    runtime = SimRuntime(cfg, log=lambda line: None, record_dir=tmp)
    result = runtime.run(sampled(cfg, r) for r in iter_workload(cfg.workload, cfg.model.vocab_size, cfg.seed))
    summary = result.log.summary(duration_s=result.duration_s or None)
    summary.update(workers=result.worker_stats, prefix_cache=result.log.stats.prefix.summary(),
                   kv_store=result.store_stats)
    return runtime, summary


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_fast_path_writes_the_same_run(case, tmp_path):
    on, on_summary = _run(tmp_path / "on", *CASES[case], "runtime.sim_fast_forward=true")
    off, off_summary = _run(tmp_path / "off", *CASES[case], "runtime.sim_fast_forward=false")
    if case == "kvstore_rejecting":
        assert 0 < on_summary["num_rejected"] < NUM_REQUESTS / 2 < on_summary["num_finished"]
    else:
        assert on_summary["num_finished"] == on_summary["num_requests"] == NUM_REQUESTS
    if case == "kvstore_2p2d_small_store":
        store = on_summary["kv_store"]
        assert store["evictions"] > 0 and store["demotions"] > 0 and store["disk_hits"] > 0 and store["hits"] > 0
    for name in ("requests.jsonl", "iterations.jsonl"):
        assert (tmp_path / "on" / name).read_bytes() == (tmp_path / "off" / name).read_bytes(), name
    assert json.dumps(on_summary) == json.dumps(off_summary)
    # not vacuous: iterations were run ahead (most of them steady decodes), none with it off
    assert on.num_steady > 0 and on.num_run_ahead > 0 and off.num_run_ahead == 0
    if case == "colocated":
        iterations = sum(1 for _ in open(tmp_path / "on" / "iterations.jsonl"))
        assert on.num_run_ahead > iterations / 2 and on.num_steady > on.num_run_ahead / 2
        assert on.num_in_runs > on.num_steady / 4      # steady stretches ran as DecodeRuns (decode_run)
    if CASES[case][0] != "mode=colocated":
        # decode workers step their steady decode batches on the short path, run ahead or not
        # (not while KV waits for a seat, as it mostly does in disagg_seats: step() seats it)
        decode_iterations = sum(1 for line in open(tmp_path / "on" / "iterations.jsonl")
                                if json.loads(line)["worker"].startswith("decode"))
        if case != "disagg_seats":
            assert on.num_steady > decode_iterations / 2
    if CASES[case][0] == "mode=disagg" and case != "disagg_seats":
        # with nothing queued for a decode worker, it decodes past the other decode worker's events
        assert on.num_in_runs > decode_iterations / 10
    if "adaptive" in case:
        # its steady decodes ran in DecodeRuns, each iteration still with its prediction
        assert on.num_in_runs > iterations_of(tmp_path / "on") / 2 and off.num_in_runs == 0
        assert all(json.loads(line)["predicted_s"] is not None for line in open(tmp_path / "on" / "iterations.jsonl"))
    if case == "colocated_preempting":
        assert on_summary["num_preemptions"] > 0    # the fallback when an allocation could fail is exercised
    # the order IterationOrder restores: by the instant each iteration ended
    rows = [json.loads(line) for line in open(tmp_path / "on" / "iterations.jsonl")]
    ends = [r["start_s"] + r["duration_s"] for r in rows]
    assert ends == sorted(ends) and len({r["worker"] for r in rows}) >= 2


def test_a_frontend_hop_turns_the_fast_path_off(tmp_path):
    """With a hop a worker's later events could reach the frontend before earlier ones."""
    hop, _ = _run(tmp_path, *CASES["colocated"], "hardware.frontend_hop_ms=0.05")
    assert hop.num_run_ahead == 0


@pytest.mark.parametrize("num_decodes", [1, 3, 40])     # 40: past the cost model's short-batch path
def test_the_cost_executors_decode_path_equals_executing_the_batch(num_decodes):
    """CostModelExecutor.execute_decodes gives what execute() gives for the same
    batch of 1-token slices (Executor's generic execute_decodes), jitter draws included."""
    model, hardware = load_model_preset("tiny"), load_hardware_preset("h100-sxm")
    requests = []
    for i in range(num_decodes):
        req = Request(f"r{i}", list(range(100 + 37 * i)), max_tokens=50)
        req.output_token_ids = [0] * (1 + i % 5)
        req.num_computed_tokens = req.num_tokens - 1
        requests.append(req)
    fast, generic = (CostModelExecutor(CostModel(model, hardware), StepJitter([-0.01, 0.0, 0.3], seed=7))
                     for _ in range(2))
    for _ in range(3):
        assert fast.execute_decodes(requests) == Executor.execute_decodes(generic, requests)


@pytest.mark.parametrize("model,scale", [("tiny", 1.0), ("llama3-8b", 1.0), ("llama3-8b", 0.8848)])
def test_decodes_priced_by_their_sum_and_longest_equal_the_slices(model, scale):
    """CostModel.decode_iteration_s (what the decode path and DecodeRuns price
    with) is iteration_time_s of the 1-token slices, float for float, on both
    sides of the short-batch path (32 slices), with a calibration scale and past
    the CUDA-graph limit (600: eager launches bound the time); None for attention that needs
    each slice (the roofline), whose executor keeps building the slices."""
    rng = random.Random(5)
    hardware = dataclasses.replace(load_hardware_preset("h100-sxm"), calibration_scale=scale)
    cost = CostModel(load_model_preset(model), hardware)
    for n in (1, 2, 7, 31, 32, 33, 200, 600):
        for _ in range(20):
            contexts = [rng.randint(1, 130_000) for _ in range(n)]
            fast = cost.decode_iteration_s(n, sum(contexts), max(contexts))
            assert fast == cost.iteration_time_s([(1, c) for c in contexts], n)
            assert type(fast) is float
            assert cost.decode_pricer(n)(sum(contexts), max(contexts)) == fast
    roofline = dataclasses.replace(load_hardware_preset("h100-sxm"), attention_kernel="")
    bare = EngineConfig(name="bare")         # no attention kernel of its own: the hardware's roofline
    assert CostModel(load_model_preset(model), roofline, engine=bare).decode_iteration_s(2, 10, 6) is None
    assert not CostModelExecutor(CostModel(load_model_preset(model), roofline, engine=bare)).prices_decodes_by_sum



@pytest.mark.parametrize("model,scale", [("llama3-8b", 1.0), ("llama3-8b", 0.8848)])
def test_a_batch_priced_after_its_decodes_equals_the_whole_batch(model, scale):
    """CostModel.pricer_after(decodes)(chunks, n) (adaptive's budget search) is
    iteration_time_s(decodes + chunks, n), float for float: on both sides of the
    short-batch path, with a recompute's catch-up (q > 1) among the head, a
    1-token chunk in the tail (priced whole), an empty tail, and on attention that
    prices each slice (the roofline: the whole batch every time)."""
    rng = random.Random(11)
    hardware = dataclasses.replace(load_hardware_preset("h100-sxm"), calibration_scale=scale)
    roofline = dataclasses.replace(load_hardware_preset("h100-sxm"), attention_kernel="")
    for cost in (CostModel(load_model_preset(model), hardware),
                 CostModel(load_model_preset(model), roofline, engine=EngineConfig(name="bare"))):
        for num_decodes in (0, 1, 5, 29, 31, 32, 40, 200):
            head = [(1, rng.randint(1, 130_000)) for _ in range(num_decodes)]
            if num_decodes > 3:
                head[2] = (17, 4_000)                     # a recompute running into its outputs
            price = cost.pricer_after(head)
            for num_chunks in (0, 1, 2, 4):
                for _ in range(5):
                    tail = [(rng.choice([1, 2, 64, 512, 3_000]), 0) for _ in range(num_chunks)]
                    tail = [(q, q + rng.randint(0, 60_000)) for q, _ in tail]
                    if not head + tail:
                        continue
                    sampled = num_decodes + rng.randint(0, num_chunks)
                    fast = price(tail, sampled)
                    assert fast == cost.iteration_time_s(head + tail, sampled), (num_decodes, tail)
                    assert type(fast) is float
    with pytest.raises(ValueError, match="num_new_tokens >= 1"):
        CostModel(load_model_preset(model), hardware).pricer_after([(1, 10)])([(0, 5)], 1)

def _sim_engine(num_blocks: int):
    from testbed.block_manager import BlockManager
    from testbed.engine import Engine, VirtualClock
    from testbed.schedulers import SchedulerConfig, make_scheduler
    bm = BlockManager(num_blocks, 16, enable_prefix_caching=True)
    scheduler = make_scheduler("sarathi", SchedulerConfig(token_budget=64, max_num_seqs=8, max_num_batched_tokens=64),
                               bm)
    executor = CostModelExecutor(CostModel(load_model_preset("tiny"), load_hardware_preset("h100-sxm")),
                                 StepJitter([-0.01, 0.0, 0.3], seed=3))
    engine = Engine(scheduler, executor, VirtualClock())
    shared = list(range(40))      # a prefix the prompts share: cached blocks, hits and evictions
    requests = [Request(f"r{i}", shared + [100 + i] * (5 + 9 * i), max_tokens=20 + 13 * i) for i in range(7)]
    for r in requests:
        engine.add_request(r)
    return engine, requests


@pytest.mark.parametrize("num_blocks", [200, 24])     # 24: a block runs short, the run stops, step() preempts
@pytest.mark.parametrize("horizon_s", [float("inf"), 0.002])
def test_a_decode_run_is_its_steady_decode_steps_one_by_one(num_blocks, horizon_s):
    """sim_decode_run.decode_run against steady_step/Engine.step one call at a
    time: the same iteration records (floats exact), tokens and token times,
    block tables as they go and the prefix cache at the end; the run stops
    before an iteration that would end past `until_s` or finish a request."""
    (by_steps, steps_requests), (by_runs, runs_requests) = _sim_engine(num_blocks), _sim_engine(num_blocks)
    seen_steps, seen_runs, num_in_runs = [], [], 0

    def state(engine):
        return sorted((r.request_id, r.num_computed_tokens, tuple(engine.bm.block_table(r.request_id)))
                      for r in engine.scheduler.running)

    free_after_steps, free_after_runs = [], {}       # what each iteration's IterationDone would say
    while by_steps.has_work():
        out = steady_step(by_steps) or by_steps.step()
        seen_steps.append((out.iteration.__dict__.copy(), state(by_steps)))
        free_after_steps.append(by_steps.bm.num_free_blocks)
    while by_runs.has_work():
        until = by_runs.clock.t + horizon_s
        run, out = decode_run(by_runs, until)
        if run is not None:
            num_in_runs += len(run.iterations)
            assert all(end < until for end in run.ends_s)
            k = len(run.iterations)
            assert all(first + k < r.max_tokens for r, first in zip(run.requests, run.first_index))
            for record in run.iterations:
                seen_runs.append((record.__dict__.copy(), None))
            free_after_runs[len(seen_runs) - 1] = run.free_blocks
        if out is None:
            out = by_runs.step()
        seen_runs.append((out.iteration.__dict__.copy(), state(by_runs)))
    assert num_in_runs > len(seen_steps) / 3
    assert [r for r, _ in seen_runs] == [r for r, _ in seen_steps]
    assert free_after_runs and all(free_after_steps[i] == free for i, free in free_after_runs.items())
    # the block tables after each iteration that ended a call
    steps_state = [s for s, (_, t) in zip(seen_steps, seen_runs) if t is not None]
    assert [t for _, t in seen_runs if t is not None] == [s for _, s in steps_state]
    assert [(r.output_token_ids, r.token_times_s, r.first_scheduled_s, r.finish_s) for r in runs_requests] == \
        [(r.output_token_ids, r.token_times_s, r.first_scheduled_s, r.finish_s) for r in steps_requests]
    assert by_runs.bm._hash_to_block == by_steps.bm._hash_to_block
    assert list(by_runs.bm._free) == list(by_steps.bm._free) and by_runs.bm.all_free()
    if num_blocks == 24:
        assert by_steps.scheduler.num_preemptions == by_runs.scheduler.num_preemptions > 0


def test_a_decode_workers_horizon_passes_only_the_events_of_workers_apart_from_it(tmp_path):
    """runtime/sim.py's _horizon on disagg 1P2D: with nothing queued, decode0
    may run up to the next event that is not decode1's; never while a worker
    outside decode1 waits with work and nothing in the heap (any event might
    start it), nor while the controller has a request queued."""
    cfg = config(*BASE, *CHAT, *CASES["disagg_vllm_v0"])
    sim = SimRuntime(cfg, log=lambda line: None, record_dir=tmp_path)
    sim.arrivals.next_s = 5.0
    assert sim._horizon("decode0") == (5.0, True)
    sim.at(1.0, sim._step, "decode1")
    sim.at(2.0, sim.deliver_kv, ("decode1", None))
    assert sim._horizon("decode0") == (5.0, True)            # decode1's events are passed
    sim.at(3.0, sim._deliver, ("prefill0", []))
    assert sim._horizon("decode0") == (3.0, True)            # prefill0's are not
    sim.at(2.5, sim.deliver_kv, ("decode0", None))
    assert sim._horizon("decode0") == (2.5, True)            # nor its own
    sim._heap.clear()
    sim.services["prefill0"].engine.add_request(Request("waits", [1] * 40, max_tokens=4))
    assert sim._horizon("decode0") == (5.0, False)           # prefill0 has work and nothing in the heap
    sim.at(4.0, sim._step, "prefill0")
    assert sim._horizon("decode0") == (4.0, True)
    sim.controller.queue.append("waits")
    assert sim._horizon("decode0") == (4.0, False)           # a queued request: no worker is apart
