"""Leases for dropped acknowledgements (transfer.lease_s), caused for real: the
frontend loses two commands (RealRuntime(on_send=...) swallows them, as a lost
message would be lost; the workers are untouched).
  - the `release` that tells the prefill worker a request's KV has landed:
    the prefill worker holds that prompt's blocks until its lease expires;
  - the `abort` of the long prompt sent to the decode worker (the client gave
    up right after its reservation): the decode worker holds 65 reserved
    blocks for KV that will never come until that lease expires, then fails
    the request it knows of (the frontend had already resolved it).
Both expire, say so (a log line, Stats.num_leases_expired), the blocks come
back, and every other request finishes with the reference tokens. A late
arrival keeps the run going past both leases."""
from __future__ import annotations

import time

import pytest

from testbed.runtime.messages import Abort, Release
from testbed.config import validate
from tests.test_disagg_faults import LONG, Watch, check, config, long_request, run

LEASE_S = 3.0


def test_expired_leases_free_the_blocks_of_lost_acknowledgements(capfd):
    cfg = config(transfer={"lease_s": LEASE_S},
                 workload={"inject_arrival_s": [0.05, LEASE_S + 2.5], "inject_prompt_len": [LONG, 32],
                           "inject_output_len": [16, 4]})
    long_rid, watch = long_request(cfg), Watch()
    lost: dict[str, str] = {}           # what was lost -> request
    expired_after: list[float] = []     # s from the lost abort to the decode worker's lease expiry
    aborted_at: list[float] = []

    def on_send(worker_id: str, msg) -> bool:
        if type(msg) is Release and worker_id == "prefill0" and msg.id != long_rid:
            lost.setdefault("release", msg.id)
            return msg.id != lost["release"]
        if type(msg) is Abort and worker_id == "decode0" and msg.id == long_rid:
            lost["abort"] = msg.id
            return False
        return True

    def hook(rt, ev) -> None:
        if ev.kind == "reserved" and ev.id == long_rid:
            aborted_at.append(time.monotonic())
            rt.controller.abort(long_rid, rt.clock.now())
        elif ev.kind == "finished" and ev.id == long_rid and "lease expired" in (ev.error or ""):
            expired_after.append(time.monotonic() - aborted_at[0])

    result = run(cfg, watch, hook, on_send)
    assert set(lost) == {"release", "abort"} and lost["release"] != long_rid
    records = check(result, cfg, {long_rid: ("aborted", "aborted by the client")}, {"prefill0", "decode0"})
    assert records[lost["release"]].status == "finished"
    stats = result.worker_stats
    assert stats["prefill0"]["num_leases_expired"] == 1 and stats["decode0"]["num_leases_expired"] == 1
    (after,) = expired_after
    assert LEASE_S <= after < LEASE_S + 2.0, after
    err = capfd.readouterr().err
    assert f"worker prefill0: no release of {lost['release']} within transfer.lease_s=3 s" in err
    assert f"worker decode0: {long_rid}: no KV within transfer.lease_s=3 s of its reservation: lease expired, " \
           f"freed its 65 blocks" in err


def test_a_lease_must_be_positive():
    with pytest.raises(ValueError, match=r"transfer\.lease_s: must be > 0 seconds, got 0"):
        validate(config(transfer={"lease_s": 0}))
