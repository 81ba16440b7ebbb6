"""Two hosts on one machine (testbed/launchers/two_nodes.py): network
namespaces A and B joined by a veth pair, a Ray head on A and a Ray worker
node on B. `testbed run` runs inside A with prefill pinned to A and decode to
B, every socket bound on the veth's addresses under the run's CURVE keys, and
the KV crossing the veth over TCP (zmq, or gloo).

Held to what the loopback runs are held to (test_launcher_ray.py,
test_disagg_faults.py): the in-process engine's tokens, every block free,
nothing left running (tests/reaped.py around the frontend; Ray's resources
all returned afterwards, so no actor or placement group outlived the run),
and the veth's own counter shows the KV went over it. Faults across nodes:
the decode actor killed mid-transfer, node B's raylet killed, a stranger on
node B without the run's keys."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from testbed.launchers.netns_nodes import NetnsNodes, namespace_pids, netns_unavailable

HERE = Path(__file__).parent
ROOT = HERE.parent
PY = sys.executable

pytestmark = pytest.mark.skipif(netns_unavailable() is not None, reason=str(netns_unavailable()))

# long enough prompts that the KV (tiny: 4 KiB per token) is MBs, not the Ray chatter
WORKLOAD = {"name": "two_nodes", "num_requests": 4, "arrival": "poisson", "rate": 20.0, "prompt_dist": "uniform",
            "prompt_min": 200, "prompt_max": 600, "output_dist": "uniform", "output_min": 4, "output_max": 8}
ARGS = ["token_budget=256", "progress=false", "wandb.mode=disabled", "timeout_s=90", "transfer.timeout_s=20",
        *(f"workload.{k}={v}" for k, v in WORKLOAD.items())]


@pytest.fixture(scope="module")
def two_nodes():
    from testbed.launchers.two_nodes import TwoNodes
    tn = TwoNodes()
    try:
        yield tn
    finally:
        ray = tn.ray
        tn.close()
        assert ray is None or ray.own_pids() == []
        assert tn.net.pids() == []
        assert not set(tn.net.names) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                                          text=True).stdout.split())


def reference_tokens() -> dict[str, list[int]]:
    sys.path.insert(0, str(HERE))
    from test_disagg_faults import reference_tokens as colocated_tokens
    from testbed.config import from_dict
    return colocated_tokens(from_dict({"workload": WORKLOAD}))


def resources_returned(tn, timeout_s: float = 30) -> tuple[dict, dict]:
    """The cluster's total and available resources, once every CPU and node resource is
    available again (no actor, no placement group left), or as they are at the timeout."""
    probe = ("import json,sys,time,ray; ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)\n"
             f"d=time.monotonic()+{timeout_s}\n"
             "while True:\n"
             " t,a={k:v for k,v in ray.cluster_resources().items() if '_group_' not in k},ray.available_resources()\n"
             " if all(a.get(k)==v for k,v in t.items() if k in ('CPU','node_a','node_b')) or time.monotonic()>d: break\n"
             " time.sleep(0.5)\n"
             "print(json.dumps([t,a]))")
    r = subprocess.run(tn.frontend(PY, "-c", probe, tn.ray.address), env=tn.env, capture_output=True, text=True,
                       timeout=timeout_s + 60)
    assert r.returncode == 0, r.stderr[-2000:]
    total, avail = json.loads(r.stdout.strip().splitlines()[-1])
    return total, avail


# slow: the cluster's start (~20 s), one run (~40 s) and its stop (~15 s) exceed a default test's minute here
@pytest.mark.slow
@pytest.mark.parametrize("transport", ["zmq", "torch_dist"])
def test_disagg_across_two_nodes_gives_the_reference_tokens(two_nodes, tmp_path, transport):
    """1P1D: prefill0 on node A, decode0 on node B; the tokens are the in-process
    engine's, every block is free, nothing outlives the run, and node A's veth sent
    at least every KV byte the summary counts."""
    tn = two_nodes
    tx_before = tn.net.tx_bytes(tn.a)
    proc = subprocess.run(tn.frontend(PY, str(HERE / "reaped.py"), PY, "-m", "testbed.cli", "run", "mode=disagg",
                                      f"transfer.transport={transport}", *ARGS, *tn.run_args(),
                                      f"hydra.run.dir={tmp_path}"),
                          env={**tn.env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=400)
    tx = tn.net.tx_bytes(tn.a) - tx_before
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["leftover"] == [], "processes outlived the run"
    records = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    ref = reference_tokens()
    assert [(r["status"], r["error"]) for r in records] == [("finished", None)] * len(ref)
    assert {r["request_id"]: r["output_token_ids"] for r in records} == ref
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["kv_blocks_leaked"] == {}
    assert set(summary["workers"]) == {"prefill0", "decode0"}
    kv_bytes = summary["kv_transfer"]["bytes"]
    assert kv_bytes >= 200 * 4096 * len(ref)          # every prompt's KV was counted
    assert tx >= kv_bytes, f"node A's veth sent {tx} B, less than the {kv_bytes} B of KV: the KV did not cross it"
    total, avail = resources_returned(tn)
    assert {k: avail.get(k) for k in ("CPU", "node_a", "node_b")} == {k: total[k] for k in ("CPU", "node_a", "node_b")}


def run_driver(tn, tmp_path, action: str, decode_workers: int, timeout: float = 400) -> dict:
    out = tmp_path / "result.json"
    spec = {"action": action, "decode_workers": decode_workers, "address": tn.ray.address, "host": tn.a.address,
            "node_b_netns": tn.b.netns}
    proc = subprocess.run(tn.frontend(PY, str(HERE / "reaped.py"), PY, str(HERE / "two_nodes_driver.py"),
                                      json.dumps(spec), str(out)),
                          env={**tn.env, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["leftover"] == [], "processes outlived the run"
    res = json.loads(out.read_text())
    res["stderr"] = proc.stderr
    return res


def check_fault(res: dict, survivors: set[str], error_of) -> set[str]:
    """The requests the fault took fail with `error_of(rid)`, their tokens so far a
    prefix of the reference; every other one finishes with the reference tokens;
    the survivors report every block free. Returns the failed requests."""
    records, ref = res["records"], res["reference"]
    failed = {rid for rid, r in records.items() if r["status"] != "finished"}
    assert res["long"] in failed
    for rid, r in records.items():
        if rid in failed:
            assert (r["status"], r["error"]) == ("failed", error_of(rid)), rid
            assert r["output_token_ids"] == ref[rid][:len(r["output_token_ids"])], rid
        else:
            assert (r["status"], r["error"], r["output_token_ids"]) == ("finished", None, ref[rid]), rid
    assert records[res["long"]]["transfer_start_s"] is not None and records[res["long"]]["transfer_end_s"] is None
    assert set(res["worker_stats"]) == survivors
    assert all(s["all_free"] for s in res["worker_stats"].values())
    return failed


SLOW_VETH_GBPS = 0.02      # the kernel's tbf on A -> B: the long prompt's 4 MiB of KV take ~1.7 s


@pytest.mark.slow
def test_decode_actor_killed_mid_transfer_across_nodes(two_nodes, tmp_path):
    """1P2D, both decode actors on node B, the veth shaped to 20 Mb/s: the decode
    actor holding the long prompt's reservation is killed (ray.kill) as its
    `prefilled` event arrives, its KV still crossing. Its requests fail with
    'worker decodeN died'; every other request finishes on the other one."""
    tn = two_nodes
    tn.net.shape(tn.a, SLOW_VETH_GBPS)
    try:
        res = run_driver(tn, tmp_path, "kill_actor", decode_workers=2)
    finally:
        tn.net.unshape(tn.a)
    dead = res["fault"]["victim"]
    failed = check_fault(res, {"prefill0", *({"decode0", "decode1"} - {dead})}, lambda rid: f"worker {dead} died")
    assert all(res["reserved_on"][rid] == dead for rid in failed)
    total, avail = resources_returned(tn)
    assert {k: avail.get(k) for k in ("CPU", "node_a", "node_b")} == {k: total[k] for k in ("CPU", "node_a", "node_b")}


@pytest.mark.slow
def test_a_stranger_on_node_b_gets_nothing_through(two_nodes, tmp_path):
    """While a run serves, a client in node B's namespace without the run's keys (no
    CURVE; a key pair of its own) connects to the frontend's two sockets and to the
    decode worker's KV receiver, posing as decode0, and sends junk: it receives
    nothing, the frontend never reads a message of it (no 'dropped' line), and
    every request finishes with the reference tokens."""
    res = run_driver(two_nodes, tmp_path, "intrude", decode_workers=1)
    report = res["intruder"]
    assert report is not None and len(res["fault"]["targets"]) == 3
    for address in res["fault"]["targets"]:
        assert report[f"{address} tcp"] == {"connect": True}, "the veth itself must be open"
        for kind in ("plain", "forged"):
            assert report[f"{address} {kind}"]["received"] == 0, (address, kind)
    assert "frontend: dropped" not in res["stderr"]
    ref = res["reference"]
    assert {rid: (r["status"], r["output_token_ids"]) for rid, r in res["records"].items()} == \
        {rid: ("finished", toks) for rid, toks in ref.items()}
    assert all(s["all_free"] for s in res["worker_stats"].values())


NODE_LOSS_BOUND_S = 60     # from node B's death to the end of the run


@pytest.mark.slow
def test_node_b_killed_mid_transfer(tmp_path):
    """1P1D on a cluster of its own: every process of node B (its namespace: the raylet,
    its daemons, the decode actor) is killed (SIGKILL) as the long prompt's `prefilled`
    event arrives. B held the only decode
    worker: the long prompt fails with 'worker decode0 died', every request not yet
    finished fails too (with that error, or 'every decode worker has died'), the
    prefill worker reports every block free, and the run ends within
    NODE_LOSS_BOUND_S of the kill."""
    from testbed.launchers.two_nodes import TwoNodes
    with TwoNodes() as tn:
        tn.net.shape(tn.a, SLOW_VETH_GBPS)
        res = run_driver(tn, tmp_path, "kill_node", decode_workers=1)
        names = tn.net.names
    assert res["fault"]["victim"] == "decode0" and res["fault"]["killed_pids"]
    errors = {"worker decode0 died", "every decode worker has died (decode0)"}
    failed = check_fault(res, {"prefill0"}, lambda rid: res["records"][rid]["error"]
                         if res["records"][rid]["error"] in errors else "one of " + " / ".join(sorted(errors)))
    assert res["records"][res["long"]]["error"] == "worker decode0 died"
    assert failed
    assert res["after_fault_s"] < NODE_LOSS_BOUND_S, res["after_fault_s"]
    print(f"node B killed: the run ended {res['after_fault_s']:.1f} s later ({len(failed)} requests failed)")
    assert tn.net.pids() == [] and not set(names) & set(subprocess.run(
        ["ip", "netns", "list"], capture_output=True, text=True).stdout.split())


def test_beyond_loopback_without_keys_is_refused_inside_a_namespace(tmp_path):
    """Inside a namespace whose veth address is not loopback: a KV receiver bound there
    without keys is refused with one line naming runtime.curve; with the run's keys it
    binds and a sender in the other namespace gets its payload through."""
    with NetnsNodes(2, prefix="tk") as net:
        a, b = net.nodes
        code = ("import sys,json\n"
                "from testbed.kv_transfer import TransferConfig, make_receiver\n"
                "from testbed.kv_transfer.curve import CurveKeys, CurveRequired\n"
                "try:\n make_receiver(TransferConfig(host=sys.argv[1]))\n print('bound')\n"
                "except CurveRequired as e:\n print('refused', e)\n"
                "keys=CurveKeys.generate(); r=make_receiver(TransferConfig(host=sys.argv[1]), curve=keys)\n"
                "print(json.dumps({'address': r.address, 'keys': keys.to_dict()}), flush=True)\n"
                "import time; got=[]; d=time.monotonic()+60\n"
                "while not got and time.monotonic()<d: got += r.poll(100)\n"
                "print('got', [p.request_id for p in got], flush=True); r.close()")
        send = ("import sys,json,torch\n"
                "from testbed.kv_transfer import TransferConfig, make_sender, pack_kv\n"
                "d=json.loads(sys.argv[1]); s=make_sender(TransferConfig(timeout_s=10), name='p', curve=d['keys'])\n"
                "cache=torch.randn(2,2,8,4,1,8); s.connect('r', d['address'])\n"
                "s.send('r', pack_kv(cache,(0,2),[1,2],[3,4],8,'across')); s.flush() if hasattr(s,'flush') else None\n"
                "import time; time.sleep(1); s.close()")
        recv = subprocess.Popen(b.exec(PY, "-c", code, b.address), stdout=subprocess.PIPE, text=True, cwd=ROOT)
        try:
            refused = recv.stdout.readline().strip()
            assert refused.startswith("refused ") and b.address in refused and "runtime.curve=true" in refused
            bound = json.loads(recv.stdout.readline())
            assert bound["address"].startswith(f"tcp://{b.address}:")
            subprocess.run(a.exec(PY, "-c", send, json.dumps(bound)), check=True, cwd=ROOT, timeout=60)
            assert recv.stdout.readline().strip() == "got ['across']"
        finally:
            recv.kill()
            recv.wait()


@pytest.mark.slow
def test_frontend_beyond_loopback_without_keys_is_refused_inside_a_namespace(tmp_path):
    """`testbed run` in a namespace, runtime.host its veth address (bindable), no keys:
    refused with the fix named, before any worker starts."""
    with NetnsNodes(2, prefix="tf") as net:
        a = net.nodes[0]
        run = subprocess.run(a.exec(PY, "-m", "testbed.cli", "run", "mode=disagg", "progress=false",
                                    "wandb.mode=disabled", f"runtime.host={a.address}", f"hydra.run.dir={tmp_path}"),
                             capture_output=True, text=True, cwd=ROOT, timeout=120)
        assert run.returncode != 0
        assert "without CURVE keys" in run.stdout + run.stderr and "runtime.curve=true" in run.stdout + run.stderr


def test_netns_nodes_shape_and_leave_nothing_behind():
    """Three namespaces in a star: each spoke reaches the other through the hub; a
    shaped link shows its tbf; close() kills what still runs inside and deletes
    every namespace (and with them the veth pairs)."""
    net = NetnsNodes(3, prefix="tc")
    try:
        hub, b, c = net.nodes
        assert [n.address for n in net.nodes] == ["10.231.1.1", "10.231.1.2", "10.231.2.2"]
        reach = ("import socket,sys\ns=socket.socket();s.settimeout(5)\n"
                 "try:\n s.connect((sys.argv[1],9))\nexcept ConnectionRefusedError:\n print('refused')\n"
                 "except OSError as e:\n print('unreachable', e)")
        # a closed port answers RST: the address was reached, across the hub
        assert subprocess.run(b.exec(PY, "-c", reach, c.address), capture_output=True, text=True,
                              timeout=30).stdout.strip() == "refused"
        assert "tbf" in net.shape(hub, 1.0) and "rate 1Gbit" in net.shape(hub, 1.0)
        before = net.tx_bytes(b)
        subprocess.run(b.exec(PY, "-c", reach, hub.address), capture_output=True, timeout=30)
        assert net.tx_bytes(b) > before
        sleeper = subprocess.Popen(c.exec("sleep", "600"))
        deadline = time.monotonic() + 5
        while sleeper.pid not in net.pids() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert sleeper.pid in net.pids()
    finally:
        net.close()
    assert sleeper.wait(timeout=10) == -9
    assert net.pids() == []
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    assert not set(net.names) & set(listed)


def test_netns_nodes_clean_up_when_their_process_is_terminated():
    """SIGTERM (a kill, a timeout's) to a process inside `with NetnsNodes(...)`: it exits
    143 through the context's exit, killing what ran inside and deleting the namespaces,
    instead of dying at once and leaving them (Python's default for SIGTERM)."""
    code = ("import subprocess, time\n"
            "from testbed.launchers.netns_nodes import NetnsNodes\n"
            "with NetnsNodes(2, prefix='tt') as net:\n"
            "    sleeper = subprocess.Popen(net.nodes[1].exec('sleep', '600'))\n"
            "    print(*net.names, sleeper.pid, flush=True)\n"
            "    time.sleep(600)\n")
    proc = subprocess.Popen([PY, "-c", code], stdout=subprocess.PIPE, text=True, cwd=ROOT)
    try:
        *names, pid = proc.stdout.readline().split()
        deadline = time.monotonic() + 10
        while int(pid) not in namespace_pids(names[1]) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert int(pid) in namespace_pids(names[1])
        proc.terminate()
        assert proc.wait(timeout=30) == 143
    finally:
        proc.kill()
        proc.wait()
    assert not set(names) & set(subprocess.run(["ip", "netns", "list"], capture_output=True,
                                               text=True).stdout.split())
    deadline = time.monotonic() + 10         # killed by close(); reaped by init once its parent is gone
    while Path(f"/proc/{pid}").exists() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not Path(f"/proc/{pid}").exists()


def test_netns_nodes_split_cpus_give_each_node_cpus_of_its_own():
    """split_cpus: what a node's exec starts runs only on that node's CPUs; the nodes' sets
    are disjoint and cover this process's CPUs (or wrap around when there are fewer)."""
    from testbed.launchers.netns_nodes import cpu_sets
    mine = sorted(os.sched_getaffinity(0))
    with NetnsNodes(2, prefix="tp", split_cpus=True) as net:
        allowed = []
        for node in net.nodes:
            out = subprocess.run(node.exec(PY, "-c", "import os; print(sorted(os.sched_getaffinity(0)))"),
                                 capture_output=True, text=True, timeout=30).stdout
            allowed.append(json.loads(out))
            assert allowed[-1] == [int(c) for c in node.cpus.split(",")]
    if len(mine) >= 2:
        assert not set(allowed[0]) & set(allowed[1]) and sorted(allowed[0] + allowed[1]) == mine
    assert cpu_sets(len(mine) + 1)[-1] == str(mine[0])           # more nodes than CPUs: wraps
    from testbed.launchers.netns_nodes import Node
    assert Node("ns", "10.0.0.1", "veth0").exec("true") == ["ip", "netns", "exec", "ns", "true"]   # any CPU
