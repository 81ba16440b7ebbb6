"""launcher=ray as a user runs it: `testbed run ... launcher=ray` with no
`ray.address` starts a local cluster (in a private, loopback-only network
namespace), places each pool in a placement group, runs every worker as a Ray
actor, and must generate exactly the tokens the in-process engine generates
(the same tokens the local launcher is held to in test_disagg.py and
test_serving.py), leave every KV block free and leave no process behind;
mode=kvstore's KV store runs as an actor beside the workers.

Each run goes through tests/reaped.py, which adopts whatever the run leaves
running: the leak check for Ray's daemons, which are not this process's
children. A worker actor killed mid-transfer (ray.kill) must fail exactly the
requests it held, as a killed process does (test_disagg_faults.py)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.config import from_dict
from testbed.engine import WallClock
from testbed.runtime.build import apply_sampling, build_engine
from testbed.workloads.build import build_workload

HERE = Path(__file__).parent
TESTBED = str(Path(sys.executable).with_name("testbed"))
WORKLOAD = {"name": "ray_test", "num_requests": 6, "arrival": "poisson", "rate": 20.0, "prompt_dist": "uniform",
            "prompt_min": 16, "prompt_max": 200, "output_dist": "uniform", "output_min": 4, "output_max": 10}
ARGS = ["token_budget=64", "progress=false", "wandb.mode=disabled", "timeout_s=90", "transfer.timeout_s=20",
        *(f"workload.{k}={v}" for k, v in WORKLOAD.items())]

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="launcher=ray's private network namespace needs root")


def reaped(*cmd: str, timeout: float = 300) -> tuple[subprocess.CompletedProcess, list[str]]:
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([sys.executable, str(HERE / "reaped.py"), *cmd], env=env, capture_output=True,
                          text=True, timeout=timeout)
    leftover = json.loads(proc.stdout.strip().splitlines()[-1])["leftover"]
    return proc, leftover


def reference_tokens() -> dict[str, list[int]]:
    cfg = from_dict({"workload": WORKLOAD, "num_kv_blocks": 256, "token_budget": 2048})
    reqs = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, reqs)
    engine = build_engine(cfg, "colocated", WallClock())
    for r in reqs:
        engine.add_request(r)
    while engine.has_work():
        engine.step()
    return {r.request_id: r.output_token_ids for r in reqs}


@pytest.fixture(scope="module")
def reference():
    return reference_tokens()


@pytest.mark.parametrize("layout", [
    pytest.param(["mode=disagg"], id="disagg-1P1D"), pytest.param(["mode=colocated", "replicas=2"], id="colocated-x2"),
    # ~60-75 s here (three actors: the store and two workers); the default suite has no room left for it
    pytest.param(["mode=kvstore"], id="kvstore-1P1D", marks=pytest.mark.slow)])
def test_ray_run_gives_the_local_tokens(reference, tmp_path, layout):
    proc, leftover = reaped(TESTBED, "run", *layout, "launcher=ray", *ARGS, f"hydra.run.dir={tmp_path}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover == [], "processes outlived the run"
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    assert [(r["status"], r["error"]) for r in records] == [("finished", None)] * len(reference)
    assert {r["request_id"]: r["output_token_ids"] for r in records} == reference
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kv_blocks_leaked"] == {}
    workers = {"replica0", "replica1"} if "mode=colocated" in layout else {"prefill0", "decode0"}
    assert set(summary["workers"]) == workers
    # every worker stepped: both replicas served, both roles took part
    its = [json.loads(line) for line in (tmp_path / "iterations.jsonl").read_text().splitlines()]
    assert {it["worker"] for it in its} == workers
    if "mode=kvstore" in layout:       # the store, a Ray actor too, took the prefill's blocks and said goodbye
        assert summary["kv_store"]["bytes_to_store"] > 0 and summary["kv_store"]["blocks_stored"] > 0


def test_ray_actor_killed_mid_transfer(tmp_path):
    """1P2D on Ray over a slow link: the decode actor holding the long prompt's
    reservation is killed (ray.kill) as its `prefilled` event arrives. Its
    requests fail with 'worker decodeN died'; every other request finishes
    with the reference tokens; the survivors report every block free."""
    out = tmp_path / "result.json"
    proc, leftover = reaped(sys.executable, str(HERE / "ray_fault_driver.py"), str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert leftover == []
    res = json.loads(out.read_text())
    dead, records, ref = res["killed"], res["records"], res["reference"]
    failed = {rid for rid, r in records.items() if r["status"] != "finished"}
    assert res["long"] in failed
    assert all(res["reserved_on"][rid] == dead for rid in failed)
    for rid, r in records.items():
        if rid in failed:
            assert (r["status"], r["error"]) == ("failed", f"worker {dead} died"), rid
            assert r["output_token_ids"] == ref[rid][:len(r["output_token_ids"])], rid
        else:
            assert (r["status"], r["error"], r["output_token_ids"]) == ("finished", None, ref[rid]), rid
    assert records[res["long"]]["transfer_start_s"] is not None and records[res["long"]]["transfer_end_s"] is None
    assert set(res["worker_stats"]) == {"prefill0", *({"decode0", "decode1"} - {dead})}
    assert all(s["all_free"] for s in res["worker_stats"].values())


def test_a_joined_cluster_passes_the_address_check_and_its_actors_read_data_dir(tmp_path, data_dir, monkeypatch):
    """A real Ray head at ray.address answers the address check; the cluster's
    processes know no data directory but an empty one ($TESTBED_DATA), so the
    worker actors, which rebuild the h100-sxm preset and check its operator
    tables, find them only through data.dir, which the launcher hands them."""
    from ray_cluster import RayCluster
    monkeypatch.setenv("TESTBED_DATA", str(tmp_path / "empty"))      # the cluster's and the driver's
    cluster = RayCluster(num_cpus=2)
    try:
        cluster.wait_nodes(1)
        proc = subprocess.run([TESTBED, "run", "mode=disagg", "launcher=ray", f"ray.address={cluster.address}",
                               "hardware=h100-sxm", "num_kv_blocks=64", "workload.num_requests=2",
                               "workload.prompt_dist=fixed", "workload.prompt_len=8", "workload.output_dist=fixed",
                               "workload.output_len=2", "progress=false", "wandb.mode=disabled", "timeout_s=90",
                               "runtime.curve=true",     # Ray names the node by an address not loopback
                               f"data.dir={data_dir}", f"hydra.run.dir={tmp_path / 'run'}"],
                              env=dict(cluster.env, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=300)
    finally:
        cluster.stop()
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = [json.loads(line) for line in (tmp_path / "run" / "requests.jsonl").read_text().splitlines()]
    assert [(r["status"], len(r["output_token_ids"])) for r in records] == [("finished", 2)] * 2
    assert not (tmp_path / "empty").exists()
