"""The seams new deployments plug into: a mode defined and registered in this
file alone runs on both runtimes; routers chosen by name; the runtimes never
branch on a mode's or role's name, bind no address the config did not give,
and import each other nowhere."""
from __future__ import annotations

import re
import subprocess

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from import_graph import ROOT, find_cycle, import_graph
from testbed.config import RunConfig, register_configs, validate
from testbed.model.config import CONF_DIR
from testbed.modes.base import ModeController, WorkerInfo
from testbed.modes.colocated import ColocatedController
from testbed.modes.pool import PoolState
from testbed.modes.registry import MODES, Mode, register_mode
from testbed.modes.routers import ROUTERS, make_router
from testbed.request import Request
from testbed.run import execute
from testbed.runtime.messages import Add


class FirstWorkerController(ModeController):
    """Every request to the first worker of the pool."""

    def route(self, req: Request, now: float) -> None:
        first = sorted(self.workers)[0]
        self.location[req.request_id] = {first}
        self.send(first, Add(self.request_msg(req)))


class FirstWorkerMode(Mode):
    name = "first_worker_test"

    def layout(self):
        return [("a0", "colocated"), ("a1", "colocated")]

    def controller(self, workers, send, copy_prompts):
        return FirstWorkerController(workers, send, copy_prompts)


@pytest.fixture
def toy_mode():
    register_mode(FirstWorkerMode)
    yield FirstWorkerMode.name
    MODES.pop(FirstWorkerMode.name)


def config(*overrides: str) -> RunConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", ["wandb.mode=disabled", "progress=false", *overrides]))


SMALL = ["workload=mixed", "workload.num_requests=6", "workload.prompt_dist=fixed", "workload.prompt_len=24",
         "workload.output_dist=fixed", "workload.output_len=4"]


@pytest.mark.parametrize("runtime", ["sim", "real"])
def test_a_mode_registered_in_a_test_file_runs_on_both_runtimes(toy_mode, runtime, tmp_path):
    cfg = config(f"runtime={runtime}", *SMALL)
    cfg.mode = toy_mode
    summary = execute(cfg, tmp_path)
    assert summary["num_finished"] == 6 and summary["mode"] == toy_mode
    assert set(summary["workers"]) == {"a0", "a1"}
    assert all(w["all_free"] for w in summary["workers"].values())
    workers = {line.split('"worker": ')[1].split(",")[0].strip('"} \n')
               for line in (tmp_path / "iterations.jsonl").read_text().splitlines()}
    assert workers == {"a0"}            # a1 never stepped


def test_an_unregistered_mode_is_refused_at_start_up_naming_the_registry():
    cfg = config("runtime=sim")
    cfg.mode = "first_worker_test"
    with pytest.raises(ValueError, match=r"mode='first_worker_test' is not known; choose one of: colocated, disagg"):
        validate(cfg)


def test_routers_by_name_pick_as_their_names_say():
    pool = PoolState({"w0": 10, "w1": 10, "w2": 10})
    req = Request("r", [1, 2, 3], 4)
    ws = ["w0", "w1", "w2"]
    rr = make_router("round_robin")
    assert [rr.pick(req, ws, pool) for _ in range(4)] == ["w0", "w1", "w2", "w0"]
    pool.add_outstanding("w0", 2)
    pool.add_outstanding("w2", 1)
    assert make_router("least_outstanding").pick(req, ws, pool) == "w1"
    pool.set_free_blocks("w1", 3)
    assert make_router("most_free_blocks").pick(req, ws, pool) == "w2"       # a tie goes to the highest id
    pool.add_prompt_tokens("w0", 100)
    pool.add_prompt_tokens("w1", 50)
    assert make_router("least_prompt_tokens").pick(req, ws, pool) == "w2"
    assert make_router("least_prompt_tokens").pick(req, ["w0", "w1"], pool) == "w1"
    assert set(ROUTERS) >= {"round_robin", "least_outstanding", "most_free_blocks", "least_prompt_tokens"}


def test_round_robin_plans_its_picks_and_the_state_reading_routers_do_not():
    pool, ws = PoolState({"w0": 10, "w1": 10, "w2": 10}), ["w0", "w1", "w2"]
    rr = make_router("round_robin")
    rr.pick(Request("r", [1], 1), ws, pool)
    plan = [rr.planned(ws, k) for k in range(5)]
    assert plan == [rr.pick(Request(f"r{k}", [1], 1), ws, pool) for k in range(5)] == ["w1", "w2", "w0", "w1", "w2"]
    for name in ("least_outstanding", "most_free_blocks", "least_prompt_tokens"):
        assert make_router(name).planned(ws, 0) is None


def test_colocated_plans_where_arrivals_go_skipping_those_that_end_at_arrival():
    """planned_targets is on_arrival's routing without its effects: a prompt that can
    never fit a replica fails at arrival ("") and takes no turn of round_robin."""
    sent = []
    workers = [WorkerInfo(f"replica{i}", "replica", num_blocks=8, block_size=16) for i in range(2)]
    ctl = ColocatedController(workers, lambda w, msg: sent.append(w), make_router("round_robin"))
    reqs = [Request("a", [1] * 20, 4), Request("huge", [1] * 200, 4), Request("b", [1] * 20, 4),
            Request("c", [1] * 20, 4)]
    assert list(ctl.planned_targets(reqs)) == ["replica0", "", "replica1", "replica0"]
    for req in reqs:
        ctl.on_arrival(req, 0.0)
    assert sent == ["replica0", "replica1", "replica0"]
    assert ctl.sink.by_id()["huge"].status == "failed"
    assert list(ctl.planned_targets(reqs[:1])) == ["replica1"]
    assert list(ColocatedController(workers, lambda w, msg: None, make_router("least_outstanding"))
                .planned_targets(reqs)) == []


@pytest.mark.parametrize("field", ["router", "prefill_router", "decode_router"])
def test_an_unknown_router_is_one_line_naming_the_field(field):
    cfg = config("runtime=sim")
    setattr(cfg, field, "nearest")
    with pytest.raises(ValueError, match=rf"^{field}='nearest' is not known; choose one of: cache_aware, least_outstanding"):
        validate(cfg)


def _git_grep(pattern: str, *paths: str) -> list[str]:
    out = subprocess.run(["git", "grep", "-nE", pattern, "--", *paths], cwd=ROOT, capture_output=True, text=True)
    return out.stdout.splitlines()


def test_no_branch_on_a_mode_or_role_name_outside_modes_conf_and_tests():
    names = "colocated|disagg|prefill|decode|kvstore|hybrid"
    hits = _git_grep(rf"(==|!=)\s*[\"']({names})[\"']|[\"']({names})[\"']\s*(==|!=)|"
                     rf"\b(mode|role)\s+(not\s+)?in\s*[\(\[{{]", "testbed", "kv_transfer", "kernels")
    assert hits == []


def test_no_loopback_literal_outside_config_defaults_and_tests():
    hits = [h for h in _git_grep(r"127\.0\.0\.1", "testbed", "modes", "kv_transfer", "kernels", "experiments")
            if not re.search(r"(host: str = \"127\.0\.0\.1\"|runtime.host`, 127\.0\.0\.1 by default)", h)]
    assert hits == []


def test_the_import_graph_has_no_cycle_and_the_runtimes_share_code_only_through_a_common_module():
    graph = import_graph()
    assert find_cycle(graph) is None
    assert "testbed.runtime.real" not in graph["testbed.runtime.sim"]
    assert "testbed.runtime.sim" not in graph["testbed.runtime.real"]
    physics = [m for m in graph if m.startswith("testbed.sim.")]
    measuring = {"testbed.runtime.real", "testbed.worker", "testbed.model_executor", "testbed.modes.registry"}
    assert all(not (graph[m] & measuring) for m in physics), {m: graph[m] & measuring for m in physics}


def test_an_error_inside_a_real_run_stops_every_worker_before_it_propagates():
    import os

    from test_disagg_faults import children
    from testbed.runtime.build import apply_sampling
    from testbed.runtime.messages import Tokens
    from testbed.runtime.real import RealRuntime
    from testbed.workloads.build import build_workload

    cfg = config("runtime=real", "replicas=2", *SMALL)
    before = children(os.getpid())

    def hook(rt, ev):
        if type(ev) is Tokens:
            raise RuntimeError("a hook failed mid-run")

    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    with pytest.raises(RuntimeError, match="a hook failed mid-run"):
        RealRuntime(cfg, on_event=hook).run(requests)
    assert children(os.getpid()) <= before


def test_the_simulator_physics_is_torch_free():
    """testbed/sim/ runs on a machine without torch: none of its modules, nor
    any project module they import, imports torch at the top."""
    import ast
    from import_graph import module_files
    files, graph = module_files(), import_graph()

    def top_level_imports(mod: str) -> set[str]:
        tree = ast.parse(files[mod].read_text())
        out = set()
        for node in tree.body:
            if isinstance(node, ast.Import):
                out |= {a.name.split(".")[0] for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                out.add(node.module.split(".")[0])
        return out

    seen, todo = set(), [m for m in graph if m.startswith("testbed.sim")]
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        assert "torch" not in top_level_imports(m), f"{m} imports torch"
        tree = ast.parse(files[m].read_text())
        todo += [n.module for n in tree.body if isinstance(n, ast.ImportFrom) and n.module in files]


def test_only_the_assembling_modules_read_the_whole_run_config():
    """Components (schedulers, engine, modes, workloads, transports, kernels,
    the simulator's physics) take their own config section; only the modules
    that assemble a run from a RunConfig import it."""
    assembling = {"testbed.capacity", "testbed.cli", "testbed.cli_errors", "testbed.run", "testbed.wandb_log", "testbed.experiments",
                  "testbed.profiling", "testbed.runtime.build", "testbed.runtime.deployment",
                  "testbed.runtime.real", "testbed.runtime.sim", "testbed.runtime.sim_split",
                  "testbed.runtime.worker_process", "testbed.analysis.blis_replay",
                  "testbed.runtime.store_process"}
    readers = {m for m, edges in import_graph().items() if "testbed.config" in edges}
    assert {m for m in readers if not any(m == a or m.startswith(a + ".") for a in assembling)} == set()
