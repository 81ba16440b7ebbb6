"""Metrics formulas pinned on hand-built timelines."""
from __future__ import annotations

import json

import numpy as np
import pytest

from testbed.batch import Batch, ScheduledSlice, StepResult
from testbed.metrics import (IterationRecord, RequestRecord, fluidity_deadlines, latency_stats_ms,
                             read_iterations, read_requests, write_jsonl)
from testbed.run_stats import summarize
from testbed.request import Request, RequestStatus


def rec(rid, arrival, times, status="finished", finish=None, scheduled=None, **kw) -> RequestRecord:
    return RequestRecord(request_id=rid, status=status, prompt_len=kw.pop("prompt_len", 10),
                         output_token_ids=list(range(len(times))), arrival_s=arrival,
                         first_scheduled_s=scheduled, first_token_s=times[0] if times else None,
                         token_times_s=list(times), finish_s=times[-1] if finish is None and times else finish, **kw)


# A: 4 tokens, TTFT 500 ms, gaps 100/100/300 ms, E2E 1000 ms, queued 100 ms.
A = rec("a", 0.0, [0.5, 0.6, 0.7, 1.0], scheduled=0.1)
# B: a one-token request: TTFT 200 ms, no TPOT.
B = rec("b", 1.0, [1.2], scheduled=1.05)
FAILED = rec("c", 0.5, [0.9, 5.0], status="failed", error="worker died")
ABORTED = rec("d", 0.2, [], status="aborted", num_preemptions=2)


def test_per_request_formulas():
    assert A.ttft_s == pytest.approx(0.5)
    assert A.tbt_s == pytest.approx([0.1, 0.1, 0.3])
    assert A.tpot_s == pytest.approx((1.0 - 0.5) / 3)
    assert A.e2e_s == pytest.approx(1.0) and A.queue_s == pytest.approx(0.1)
    assert B.tpot_s is None and B.tbt_s == [] and B.ttft_s == pytest.approx(0.2)
    assert ABORTED.ttft_s is None and ABORTED.e2e_s is None


def test_percentiles_on_a_known_array():
    stats = latency_stats_ms(np.arange(1, 1001) / 1000.0)      # 1..1000 ms
    assert stats == pytest.approx({"mean": 500.5, "p50": 500.5, "p90": 900.1, "p99": 990.01,
                                   "p999": 999.001, "max": 1000.0})
    assert latency_stats_ms([]) == {"mean": None, "p50": None, "p90": None, "p99": None, "p999": None, "max": None}


def test_summary_counts_only_finished_requests_in_latency():
    s = summarize([A, B, FAILED, ABORTED], [], slo_ttft_ms=300, slo_tpot_ms=200, duration_s=2.0)
    assert (s["num_requests"], s["num_finished"], s["num_failed"], s["num_aborted"]) == (4, 2, 1, 1)
    assert s["first_error"] == {"failed": "worker died"}       # ABORTED carries no error
    assert s["num_preemptions"] == 2 and s["num_single_token"] == 1
    assert s["ttft_ms"]["mean"] == pytest.approx(350.0) and s["ttft_ms"]["max"] == pytest.approx(500.0)
    # TPOT: only A (B has one token and is excluded)
    assert s["tpot_ms"]["mean"] == pytest.approx(500 / 3) and s["tpot_ms"]["max"] == pytest.approx(500 / 3)
    # TBT pools A's gaps [100, 100, 300]; FAILED's 4.1 s gap is not counted
    assert s["tbt_ms"]["p50"] == pytest.approx(100.0)
    assert s["tbt_ms"]["p90"] == pytest.approx(260.0)          # 100 + 0.8 * (300 - 100)
    assert s["tbt_ms"]["max"] == pytest.approx(300.0)
    assert s["e2e_ms"]["max"] == pytest.approx(1000.0) and s["queue_ms"]["mean"] == pytest.approx(75.0)
    assert s["throughput"] == pytest.approx({"requests_per_s": 1.0, "output_tokens_per_s": 2.5,
                                             "total_tokens_per_s": 12.5})


def test_goodput_follows_vllm():
    # TTFT SLO 300 ms: A (500 ms) misses, B meets and has no TPOT to miss
    s = summarize([A, B, FAILED], [], slo_ttft_ms=300, slo_tpot_ms=100, duration_s=4.0)
    assert s["goodput"] == pytest.approx(0.25) and s["slo_attainment"] == pytest.approx(1 / 3)
    # TTFT SLO 600: A meets TTFT but its TPOT 166.7 ms misses 100 ms
    assert summarize([A, B], [], 600, 100, duration_s=4.0)["goodput"] == pytest.approx(0.25)
    assert summarize([A, B], [], 600, 170, duration_s=4.0)["goodput"] == pytest.approx(0.5)
    assert summarize([A, B], [], None, None, duration_s=4.0)["goodput"] == pytest.approx(0.5)


def test_duration_defaults_to_first_arrival_to_last_event():
    s = summarize([A, B], [IterationRecord(1.1, 0.4, 5, 1)], 1000, 1000)
    assert s["duration_s"] == pytest.approx(1.5)                # 0.0 .. iteration end 1.5
    assert s["throughput"]["requests_per_s"] == pytest.approx(2 / 1.5)


def test_fluidity_gap_of_three_deadlines_counts_three_misses():
    r = rec("x", 0.0, [0.1, 0.2, 0.5])          # intervals 100, 100, 300 ms
    assert fluidity_deadlines(r, 0.1, 0.1) == (3, 5)
    s = summarize([r], [], slo_ttft_ms=100, slo_tpot_ms=100, duration_s=1.0)
    assert s["fluidity_index"] == pytest.approx(1 - 3 / 5)
    assert fluidity_deadlines(rec("y", 0.0, [0.1, 0.2, 0.45]), 0.1, 0.1) == (2, 4)   # 250 ms gap: 2 misses


def test_fluidity_slack_carries_forward_and_resets_after_a_miss():
    late_stall = rec("late", 0.0, [0.05, 0.10, 0.15, 0.35])    # 150 ms banked absorbs the 200 ms gap
    early_stall = rec("early", 0.0, [0.05, 0.25, 0.30, 0.35])  # only 50 ms banked: one miss
    assert fluidity_deadlines(late_stall, 0.1, 0.1) == (0, 4)
    assert fluidity_deadlines(early_stall, 0.1, 0.1) == (1, 4)
    # a late first token misses with the TBT period: TTFT 450 ms vs 200 ms -> floor(250/100) + 1
    assert fluidity_deadlines(rec("t", 0.0, [0.45]), 0.2, 0.1) == (3, 3)
    s = summarize([late_stall, early_stall], [], 100, 100, duration_s=1.0)
    assert s["fluidity_index"] == pytest.approx(1 - 1 / 8)
    assert s["fluidity_index_mean"] == pytest.approx((1.0 + 0.75) / 2)
    assert summarize([late_stall], [], None, 100)["fluidity_index"] is None


def test_fluidity_uses_tbt_slo_when_given():
    r = rec("x", 0.0, [0.1, 0.2, 0.5])
    assert summarize([r], [], 100, 1000, slo_tbt_ms=100)["fluidity_index"] == pytest.approx(0.4)
    assert summarize([r], [], 100, 1000)["fluidity_index"] == pytest.approx(1.0)


def test_kv_transfer_summary_only_when_transfers_exist():
    assert "kv_transfer" not in summarize([A], [], 1000, 1000)
    t1 = rec("t1", 0.0, [0.5, 1.0], kv_bytes_sent=1_000_000_000, transfer_start_s=0.5, transfer_end_s=1.0,
             exposed_transfer_s=0.1)
    t2 = rec("t2", 0.0, [0.5, 1.0], kv_bytes_sent=500_000_000, transfer_start_s=0.5, transfer_end_s=1.0,
             exposed_transfer_s=0.3)
    kv = summarize([t1, t2, A], [], 1000, 1000)["kv_transfer"]
    assert kv["num_transfers"] == 2 and kv["bytes"] == 1_500_000_000
    assert kv["transfer_ms"]["mean"] == pytest.approx(500.0)
    assert kv["exposed_ms"]["max"] == pytest.approx(300.0) and kv["exposed_ms"]["mean"] == pytest.approx(200.0)
    assert kv["achieved_gb_per_s"] == pytest.approx(1.5)


def test_iteration_summary():
    its = [IterationRecord(0.0, 0.010, 512, 8, 1000), IterationRecord(0.01, 0.030, 0, 8, 500, worker="w0")]
    it = summarize([], its, 100, 100)["iterations"]
    assert it["num_iterations"] == 2 and it["max_tokens_per_iteration"] == 520
    assert (it["num_prefill_tokens"], it["num_decode_tokens"], it["kv_bytes_read"]) == (512, 16, 1500)
    assert it["duration_ms"]["mean"] == pytest.approx(20.0)


def test_summary_is_plain_json():
    s = summarize([A, B, FAILED, ABORTED], [IterationRecord(0, 0.1, 1, 1)], 300, 200)
    assert json.loads(json.dumps(s, allow_nan=False)) == s
    empty = summarize([], [], 100, 100)
    assert empty["num_requests"] == 0 and empty["throughput"]["requests_per_s"] == 0.0
    assert empty["ttft_ms"]["p99"] is None and empty["fluidity_index"] is None


def test_from_request_and_from_step():
    req = Request("r7", [1, 2, 3, 4, 5], max_tokens=2, arrival_s=0.5)
    req.first_scheduled_s, req.token_times_s, req.output_token_ids = 0.6, [0.8, 0.9], [11, 12]
    req.num_computed_tokens, req.status, req.finish_s = 6, RequestStatus.FINISHED, 0.9
    r = RequestRecord.from_request(req, kv_bytes_sent=64)
    assert (r.request_id, r.status, r.prompt_len, r.output_token_ids) == ("r7", "finished", 5, [11, 12])
    assert (r.first_token_s, r.token_times_s, r.kv_bytes_sent) == (0.8, [0.8, 0.9], 64)
    assert r.ttft_s == pytest.approx(0.3) and r.queue_s == pytest.approx(0.1)

    prefill = Request("p", list(range(20)), max_tokens=1)
    batch = Batch([ScheduledSlice(prefill, 8), ScheduledSlice(req, 1)])
    it = IterationRecord.from_step(2.0, batch, StepResult({}, 0.015, kv_bytes_read=4096), worker="colocated-0")
    assert (it.start_s, it.duration_s, it.num_prefill_tokens, it.num_decode_tokens, it.kv_bytes_read, it.worker) \
        == (2.0, 0.015, 8, 1, 4096, "colocated-0")


def test_jsonl_round_trip(tmp_path):
    write_jsonl(tmp_path / "requests.jsonl", [A, B, FAILED, ABORTED])
    write_jsonl(tmp_path / "iterations.jsonl", [IterationRecord(0.0, 0.01, 3, 4, 5, "w")])
    assert read_requests(tmp_path / "requests.jsonl") == [A, B, FAILED, ABORTED]
    assert read_iterations(tmp_path / "iterations.jsonl") == [IterationRecord(0.0, 0.01, 3, 4, 5, "w")]
    first = json.loads((tmp_path / "requests.jsonl").read_text().splitlines()[0])
    assert {"request_id", "status", "prompt_len", "output_token_ids", "arrival_s", "first_token_s",
            "token_times_s", "finish_s", "num_preemptions"} <= set(first)


def test_jsonl_lines_are_json_dumps_of_the_fields(tmp_path):
    """write_jsonl encodes a column at a time: each line must still be exactly
    json.dumps of the record's field dict, whatever the values hold (a ", "
    inside a string, NaN, None, numpy floats, lists), across chunk boundaries."""
    from dataclasses import fields
    iters = [IterationRecord(i * 0.1, float("nan") if i == 3 else 1e-300 * i, i, 0, 2**70, w)
             for i, w in enumerate(["w", None, "a, b", 'q"\\\n, ü'] * 1500)]
    iters.append(IterationRecord(np.float64(0.1), -0.0, True, 1, 2, "w"))
    records = [A, rec("r, 1", 0.0, [0.1, float("inf")], status="failed", error="x, y"), *iters, B, FAILED, ABORTED]
    write_jsonl(tmp_path / "mixed.jsonl", records)
    expected = [json.dumps({f.name: getattr(r, f.name) for f in fields(r)}) for r in records]
    assert (tmp_path / "mixed.jsonl").read_text().splitlines() == expected


def test_jsonl_errors_name_file_and_line(tmp_path):
    path = tmp_path / "iterations.jsonl"
    path.write_text('{"start_s": 0, "duration_s": 1, "num_prefill_tokens": 1, "num_decode_tokens": 0}\n'
                    '{"start_s": 0, "duration_s": 1, "num_prefill_tokens": 1, "num_decode": 0}\n')
    with pytest.raises(ValueError, match=rf"{path}:2: unknown field\(s\) \['num_decode'\]"):
        read_iterations(path)
    path.write_text('{"start_s": 0, "duration_s": 1, "num_prefill_tokens": 1}\n')
    with pytest.raises(ValueError, match=rf"{path}:1: .*num_decode_tokens"):
        read_iterations(path)
    path.write_text('{"start_s": 0,\n')
    with pytest.raises(ValueError, match=rf"{path}:1: not valid JSON"):
        read_iterations(path)


def test_the_printed_summary_says_why_requests_failed(tmp_path, capsys):
    """A run whose every request failed prints how many and the first one's
    error, not only 0/N finished (a prompt larger than the whole KV pool)."""
    from testbed.config import from_dict
    from testbed.run import execute
    cfg = from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"},
                     "progress": False, "num_kv_blocks": 4,
                     "workload": {"num_requests": 3, "prompt_min": 100, "prompt_max": 120, "output_min": 4,
                                  "output_max": 8, "rate": 50.0}})
    summary = execute(cfg, tmp_path / "run")
    assert (summary["num_finished"], summary["num_failed"]) == (0, 3)
    first = read_requests(tmp_path / "run" / "requests.jsonl")[0].error
    assert "num_kv_blocks" in first and summary["first_error"] == {"failed": first}
    lines = [line for line in capsys.readouterr().out.splitlines() if line.strip().startswith("failed")]
    assert len(lines) == 1 and lines[0].split()[1] == "3" and "first: prompt of" in lines[0]
