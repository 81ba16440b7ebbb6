"""Run by test_launcher_ray.py in a process of its own (launcher=ray moves the
process into a private network namespace): test_disagg_faults.py's decode
kill mid-transfer, with the worker as a Ray actor killed by ray.kill. Writes
what the test checks as JSON to argv[1]."""
from __future__ import annotations

import dataclasses
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from test_disagg_faults import SLOW_LINK, config, long_request, reference_tokens, workload  # noqa: E402

from testbed.runtime.real import RealRuntime  # noqa: E402


def main(out: str) -> None:
    cfg = config(decode_workers=2, launcher="ray", transfer=SLOW_LINK)
    ref = reference_tokens(cfg)
    long_rid, reserved_on, killed = long_request(cfg), {}, []

    def hook(rt, ev) -> None:
        if ev.kind == "reserved":
            reserved_on[ev.id] = ev.worker
        if ev.kind == "prefilled" and ev.id == long_rid and not killed:
            killed.append(reserved_on[long_rid])
            rt.kill(killed[0])

    result = RealRuntime(cfg, on_event=hook).run(workload(cfg))
    Path(out).write_text(json.dumps({
        "killed": killed[0], "long": long_rid, "reserved_on": reserved_on, "reference": ref,
        "records": {r.request_id: dataclasses.asdict(r) for r in result.records},
        "worker_stats": result.worker_stats}, default=str))


if __name__ == "__main__":
    main(sys.argv[1])
