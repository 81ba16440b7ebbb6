"""A slow receiver, caused for real: one decode worker of a 1P2D disagg run is
duty-cycled with SIGSTOP/SIGCONT (stopped 90% of the time, so it reads,
steps and answers at a tenth of its speed) from the moment every request of
a burst has its reservation: the prefill worker keeps computing the prompts,
and the KV of those reserved on the slowed worker queues for it.

Asserted: the prefill worker's memory stays bounded (its VmRSS, sampled from
/proc while the run goes, grows by less than the per-peer window
transfer.max_inflight_mb allows, plus one request and allocator slack; with
SNDHWM 0 and no window it grew with every request queued for the stopped
peer); the other decode worker's requests finish with the reference tokens
and their mean inter-token gap stays within a loose bound of the same
run's with nobody slowed; the slowed worker's requests finish late, or fail with a lease
status; every block is free at the end; no process or port outlives the run.
Those runs are slow-marked; the default suite has the window's bookkeeping
and two real KV ports in one process, one not reading."""
from __future__ import annotations

import os
import signal
import statistics
import sys
import threading
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
from test_disagg_faults import Watch, config, reference_tokens, run, workload  # noqa: E402

from testbed.kv_transfer.window import SendWindow  # noqa: E402
from testbed.runtime.messages import Event  # noqa: E402
from testbed.runtime.real import RealRuntime  # noqa: E402

MiB = 1 << 20
KV_BYTES_PER_TOKEN = 2048            # tiny: 4 layers x (k, v) x 2 kv heads x 64 x fp32
SLOWED = "decode1"


def test_window_admits_per_request_and_settles_on_ack():
    w = SendWindow(4 * MiB)
    assert w.admits("d0", "a", 10 * MiB)           # an empty window takes even a request larger than itself
    w.sent("d0", "a", 10 * MiB)
    assert not w.admits("d0", "b", 1)              # full
    assert w.admits("d0", "a", 10 * MiB) and w.holds("a")      # a's later pieces (layer-wise) still go
    assert w.admits("d1", "c", 3 * MiB)            # another peer's window is its own
    w.sent("d1", "c", 3 * MiB)
    assert not w.admits("d1", "d", 2 * MiB) and w.admits("d1", "d", 1 * MiB)
    w.settle("a")
    assert w.in_flight("d0") == 0 and w.admits("d0", "b", 4 * MiB) and not w.holds("a")
    w.settle("a")                                   # settling twice (ack after release) is harmless
    assert (w.in_flight("d0"), w.in_flight("d1"), w.peak_bytes["d0"]) == (0, 3 * MiB, 10 * MiB)
    with pytest.raises(ValueError, match="transfer.max_inflight_mb"):
        SendWindow(0)


def vm_rss(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"no VmRSS for {pid}")


class SlowReceiver:
    """Stops `pid` for 90% of every period_s, from a thread, until stop()."""

    def __init__(self, pid: int, period_s: float) -> None:
        self.pid, self.period_s = pid, period_s
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._done.is_set():
                os.kill(self.pid, signal.SIGSTOP)
                self._done.wait(0.9 * self.period_s)
                os.kill(self.pid, signal.SIGCONT)
                self._done.wait(0.1 * self.period_s)
        except ProcessLookupError:
            pass
        finally:
            try:
                os.kill(self.pid, signal.SIGCONT)
            except ProcessLookupError:
                pass

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


class RssSampler:
    def __init__(self, pid: int, every_s: float = 0.005) -> None:
        self.pid, self.every_s = pid, every_s
        self.samples: list[int] = [vm_rss(pid)]
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._done.wait(self.every_s):
            try:
                self.samples.append(vm_rss(self.pid))
            except (OSError, RuntimeError):
                return

    def stop(self) -> None:
        self._done.set()
        self._thread.join(5)


def gaps(rec) -> list[float]:
    """Inter-token gaps after the second token (the first gap holds the KV transfer)."""
    t = rec.token_times_s
    return [b - a for a, b in zip(t[1:], t[2:])]


def wire_bytes(prompt_len: int, block_size: int = 16) -> int:
    """A prompt's KV as sent: whole blocks."""
    return -(-prompt_len // block_size) * block_size * KV_BYTES_PER_TOKEN


def run_with_slow_receiver(num_requests: int, max_inflight_mb: float, prompt_max: int, period_s: float | None):
    cfg = config(decode_workers=2, timeout_s=120, num_kv_blocks=512,
                 transfer={"transport": "zmq", "max_inflight_mb": max_inflight_mb, "lease_s": 60},
                 workload={"num_requests": num_requests, "arrival": "burst",
                           "prompt_min": prompt_max // 2, "prompt_max": prompt_max, "output_min": 8, "output_max": 24,
                           "inject_arrival_s": [], "inject_prompt_len": [], "inject_output_len": []})
    watch, slow, rss = Watch(), [], []

    def hook(rt: RealRuntime, ev: Event) -> None:
        if not rss:
            rss.append(RssSampler(rt.launcher.pid("prefill0")))
        # it turns slow with reservations in hand: once every request of the burst has its blocks, while
        # the prefill worker still has most of their prompts to compute (a reservation asked of a
        # stopped worker would hold the whole queue back, and nothing would be sent to it)
        if period_s and not slow and ev.kind == "reserved" and len(watch.reserved_on) == num_requests:
            slow.append(SlowReceiver(rt.launcher.pid(SLOWED), period_s))
        if slow and ev.kind == "finished" and sum(e.kind == "finished" for e in watch.events) == num_requests:
            slow[0].stop()                  # every request is done: let the shutdown go at full speed

    try:
        result = run(cfg, watch, hook)
    finally:
        for helper in slow + rss:
            helper.stop()
    return cfg, watch, result, rss[0].samples


def check_slow_receiver_run(num_requests: int, max_inflight_mb: float, prompt_max: int = 1024,
                            period_s: float | None = 2.0) -> dict:
    cfg, watch, result, samples = run_with_slow_receiver(num_requests, max_inflight_mb, prompt_max, period_s)
    ref = reference_tokens(cfg)
    records = {r.request_id: r for r in result.records}
    assert set(records) == {r.request_id for r in workload(cfg)}
    on_slowed = {rid for rid, w in watch.reserved_on.items() if w == SLOWED}
    assert on_slowed and len(on_slowed) < num_requests, "both decode workers must serve requests"
    for rid, rec in records.items():
        if rec.status == "finished":
            assert rec.output_token_ids == ref[rid], rid
        else:        # only the slowed worker's, and only by its lease
            assert rid in on_slowed and rec.status == "failed" and "lease expired" in rec.error, (rid, rec.error)
    others = [records[rid] for rid in records if rid not in on_slowed]
    assert all(r.status == "finished" for r in others)
    # the mean gap: a stopped worker decodes in bursts, so most of its gaps are short and a few long
    fast_gap = statistics.mean(g for r in others for g in gaps(r))
    slow_gap = statistics.mean([g for rid in on_slowed for g in gaps(records[rid])
                                if records[rid].status == "finished"] or [0.0])
    assert set(result.worker_stats) == {"prefill0", "decode0", "decode1"}
    for w, s in result.worker_stats.items():
        assert s["all_free"] and s["num_free_blocks"] == s["num_blocks"], (w, s)
    growth = max(samples) - samples[0]
    prefill = result.worker_stats["prefill0"]
    largest = max(wire_bytes(r.prompt_len) for r in workload(cfg))
    print(f"\n{'slow receiver' if period_s else 'no slowing'}, max_inflight_mb={max_inflight_mb:g}: prefill VmRSS {samples[0] / MiB:.1f} MiB at the "
          f"start, peak {max(samples) / MiB:.1f} MiB (+{growth / MiB:.1f} MiB, {len(samples)} samples); mean "
          f"inter-token gap {1000 * fast_gap:.1f} ms on decode0, {1000 * slow_gap:.1f} ms on the slowed {SLOWED} "
          f"({len(on_slowed)} of {num_requests} requests); KV in flight to one peer at most "
          f"{prefill['kv_peak_inflight_bytes'] / MiB:.2f} MiB, {prefill['kv_sends_waited']} sends waited for "
          "the window")
    # an empty window admits one request whole, however large; otherwise the window holds
    assert prefill["kv_peak_inflight_bytes"] <= max(max_inflight_mb * MiB, largest), prefill
    # the slow receiver really held KV back: sends waited for its window
    assert prefill["kv_sends_waited"] > 0 or not period_s, prefill
    # in flight (at most the larger of the window and one request), pooled staging buffers (at
    # most the same again) and 16 MiB for the engine's and the allocator's own growth
    assert growth < 2 * max(max_inflight_mb * MiB, largest) + 16 * MiB, growth
    return {"growth": growth, "fast_gap": fast_gap, "slow_gap": slow_gap, **prefill}


@pytest.mark.slow        # ~50 s here: process start-up, and the slowed worker's requests at a tenth of the speed
def test_slow_receiver_bounds_the_senders_memory_and_spares_the_other_decode_worker():
    # every prompt (1-2 MiB of KV) is over the window: the slowed worker's second waits for its first's ack,
    # which can only come in a 0.2 s run of every 2 s, while the prefill worker computes a prompt in ~0.2 s
    slowed = check_slow_receiver_run(num_requests=8, max_inflight_mb=0.5, prompt_max=1024)
    # the same run with nobody slowed: decode0's gaps must not grow much with its neighbour slowed. A
    # loose bound (x2 + 20 ms) because which requests share decode0's batches, and the machine's other
    # load, differ between the runs; a decode0 that waited on the slowed peer (a blocked prefill worker,
    # a shared queue) would show gaps of the stop's length, 1.8 s
    alone = check_slow_receiver_run(num_requests=8, max_inflight_mb=0.5, prompt_max=1024, period_s=None)
    assert slowed["fast_gap"] < 2 * alone["fast_gap"] + 0.020, (slowed["fast_gap"], alone["fast_gap"])


@pytest.mark.slow
def test_slow_receiver_with_more_and_longer_prompts():
    check_slow_receiver_run(num_requests=16, max_inflight_mb=1, prompt_max=1024)


def test_port_holds_sends_beyond_the_window_until_acks_free_room():
    """Two real KV ports in this process (tiny engines, zmq): the receiving
    port is not polled (a receiver that does not read), so sends beyond the
    window wait, unpacked; once it reads, acks free room and every request's
    KV lands exactly; a waiting send cancelled never goes."""
    from testbed.config import from_dict
    from testbed.engine import WallClock
    from testbed.launchers.base import WorkerSpec
    from testbed.request import Request
    from testbed.runtime.build import build_engine
    from testbed.runtime.real_kv_port import RealKVPort

    import torch
    cfg = from_dict({"mode": "disagg", "num_kv_blocks": 64, "transfer": {"max_inflight_mb": 0.25},
                     "wandb": {"mode": "disabled"}})
    spec = {"needs_kv_port": True, "rank": 0, "world_size": 2, "cmd_addr": "", "event_addr": "", "t0": 0.0,
            "dist_addr": None, "cfg": {}}
    prefill_engine, decode_engine = (build_engine(cfg, role, WallClock()) for role in ("prefill", "decode"))
    prefill = RealKVPort(cfg.transfer, WorkerSpec(worker_id="prefill0", role="prefill", **spec), prefill_engine,
                         sends=True, receives=False)
    decode = RealKVPort(cfg.transfer, WorkerSpec(worker_id="decode0", role="decode", **spec), decode_engine,
                        sends=False, receives=True)
    try:
        prefill_engine.executor.kv_cache.copy_(torch.randn_like(prefill_engine.executor.kv_cache))
        prefill.connect("decode0", decode.address)
        blocks = {}
        for i in range(5):                      # 4 blocks of 16 tokens each: 128 KiB of KV per request
            req = Request(f"r{i}", list(range(64)), 1)
            assert prefill_engine.bm.allocate(req, 64) and decode_engine.bm.allocate(req, 64)
            blocks[req.request_id] = (prefill_engine.bm.block_table(req.request_id),
                                      decode_engine.bm.block_table(req.request_id))
            src, dst = blocks[req.request_id]
            prefill.send(req.request_id, "decode0", src, dst, 64, (0, 4), True, {"i": i})
        # the window (256 KiB) took two; three wait, unpacked
        assert prefill.window.in_flight("decode0") == 2 * wire_bytes(64)
        assert prefill.num_sends_waited == 3
        prefill.cancel("r4")                     # released while waiting: it never goes
        arrived, deadline = [], time.monotonic() + 20
        while len(arrived) < 4 and time.monotonic() < deadline:
            arrived += decode.poll()
            prefill.pump(None)
            time.sleep(0.001)
        assert sorted(a.request_id for a in arrived) == ["r0", "r1", "r2", "r3"]
        assert all(a.ok and a.last for a in arrived)
        time.sleep(0.2)
        assert decode.poll() == []
        for rid in ("r0", "r1", "r2", "r3"):
            src, dst = blocks[rid]
            assert torch.equal(decode_engine.executor.kv_cache[:, :, dst], prefill_engine.executor.kv_cache[:, :, src])
        prefill.pump(None)
        assert prefill.window.in_flight("decode0") == 0
        assert prefill.stats()["kv_peak_inflight_bytes"] == 2 * wire_bytes(64)
    finally:
        prefill.close()
        decode.close()


def ttfts_on(records: dict, watch: Watch, worker: str) -> list[float]:
    return [records[rid].ttft_s for rid, w in watch.reserved_on.items() if w == worker]


def run_slowed_from_the_start(period_s: float | None):
    """1P2D, a burst; decode1 duty-cycled from the first event on, so it is stopped when it is asked to
    reserve (the case run_with_slow_receiver steers clear of)."""
    cfg = config(decode_workers=2, timeout_s=120, num_kv_blocks=512,
                 transfer={"transport": "zmq", "lease_s": 60},
                 workload={"num_requests": 8, "arrival": "burst", "prompt_min": 256, "prompt_max": 512,
                           "output_min": 8, "output_max": 16,
                           "inject_arrival_s": [], "inject_prompt_len": [], "inject_output_len": []})
    watch, slow = Watch(), []

    def hook(rt: RealRuntime, ev: Event) -> None:
        if period_s and not slow:
            slow.append(SlowReceiver(rt.launcher.pid(SLOWED), period_s))
        if slow and ev.kind == "finished" and sum(e.kind == "finished" for e in watch.events) == 8:
            slow[0].stop()

    try:
        result = run(cfg, watch, hook)
    finally:
        for helper in slow:
            helper.stop()
    records = {r.request_id: r for r in result.records}
    ref = reference_tokens(cfg)
    for rid, rec in records.items():
        assert rec.status == "finished" and rec.output_token_ids == ref[rid], (rid, rec.status, rec.error)
    for w, s in result.worker_stats.items():
        assert s["all_free"], (w, s)
    return records, watch


@pytest.mark.slow        # ~40 s here: two runs
def test_a_decode_worker_slow_to_answer_holds_back_only_itself():
    """A reservation asked of a stopped decode worker is answered up to 1.8 s late. One reservation in
    flight per decode worker (modes/disagg.py) lets the queue go on to decode0 meanwhile, so decode0's
    requests reach their first token about as fast as with nobody slowed; one reservation in flight
    for the whole run would add the stops to every request queued behind it."""
    slowed, watch = run_slowed_from_the_start(period_s=2.0)
    alone, alone_watch = run_slowed_from_the_start(period_s=None)
    fast = ttfts_on(slowed, watch, "decode0")
    assert fast and len(fast) < 8, "both decode workers must serve requests"
    baseline = max(r.ttft_s for r in alone.values())
    print(f"\ndecode0's TTFT with decode1 slowed: max {1000 * max(fast):.0f} ms over {len(fast)} requests; "
          f"nobody slowed: max {1000 * baseline:.0f} ms over 8")
    # half a stop: a decode0 request queued behind a reservation asked of the stopped worker waits for
    # it, 0.9 s on average per such reservation, and the slowed worker is asked several times
    assert max(fast) < baseline + 0.9, (max(fast), baseline)
