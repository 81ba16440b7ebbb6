"""Run by test_two_nodes.py inside node A's namespace, joined to the two-node
Ray cluster: test_disagg_faults.py's workload on RealRuntime, with one fault
chosen by argv[1] (a JSON object):

- "kill_actor": ray.kill the decode actor holding the long prompt's
  reservation as its `prefilled` event arrives (its KV on the shaped veth);
- "kill_node": SIGKILL every process in node B's namespace then (the host dies);
- "intrude": at the first reservation, start tests/two_nodes_intruder.py in
  node B's namespace against the frontend's sockets and the decode worker's
  KV receiver, wait for its report, and keep it.

Writes what the test checks as JSON to argv[2]."""
from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_disagg_faults import config, long_request, reference_tokens, workload  # noqa: E402

from testbed.launchers.netns_nodes import kill_namespace  # noqa: E402
from testbed.runtime.real import RealRuntime  # noqa: E402


def main(spec: dict, out: str) -> None:
    cfg = config(decode_workers=spec["decode_workers"], launcher="ray", timeout_s=spec.get("timeout_s", 60),
                 ray={"address": spec["address"], "resources": {"prefill": "node_a", "decode": "node_b"}},
                 runtime={"host": spec["host"], "curve": True, "hang_timeout_s": 20.0},
                 transfer={"host": spec["host"], "timeout_s": 10})
    ref = reference_tokens(cfg)
    long_rid, reserved_on, fault, intruder = long_request(cfg), {}, {}, []

    def hook(rt: RealRuntime, ev) -> None:
        if ev.kind == "reserved":
            reserved_on[ev.id] = ev.worker
        if spec["action"] == "intrude" and ev.kind == "reserved" and not intruder:
            targets = [rt.cmd.getsockopt(zmq_last_endpoint()).decode(),
                       rt.events.getsockopt(zmq_last_endpoint()).decode(), rt.kv_addresses[ev.worker]]
            intruder.append(subprocess.Popen(
                ["ip", "netns", "exec", spec["node_b_netns"], sys.executable,
                 str(Path(__file__).with_name("two_nodes_intruder.py")), *targets],
                stdout=subprocess.PIPE, text=True))
            fault["targets"] = targets
            # the frontend waits (a few seconds, well within runtime.frontend_timeout_s) so that
            # its sockets are surely up while the stranger tries them; it reads them afterwards
            fault["intruder_out"] = intruder[0].communicate(timeout=12)[0]
        if ev.kind == "prefilled" and ev.id == long_rid and "at" not in fault and spec["action"] != "intrude":
            fault["at"] = time.monotonic()
            fault["victim"] = reserved_on[long_rid]
            if spec["action"] == "kill_actor":
                rt.kill(fault["victim"])
            else:
                fault["killed_pids"] = kill_namespace(spec["node_b_netns"])

    t0 = time.monotonic()
    result = RealRuntime(cfg, on_event=hook).run(workload(cfg))
    end = time.monotonic()
    report = None
    if intruder:
        report = json.loads(fault.pop("intruder_out").strip().splitlines()[-1])
    Path(out).write_text(json.dumps({
        "fault": fault, "long": long_rid, "reserved_on": reserved_on, "reference": ref,
        "run_s": end - t0, "after_fault_s": end - fault["at"] if "at" in fault else None, "intruder": report,
        "records": {r.request_id: dataclasses.asdict(r) for r in result.records},
        "worker_stats": result.worker_stats}, default=str))


def zmq_last_endpoint() -> int:
    import zmq
    return zmq.LAST_ENDPOINT


if __name__ == "__main__":
    main(json.loads(sys.argv[1]), sys.argv[2])
