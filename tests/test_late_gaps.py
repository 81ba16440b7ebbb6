"""testbed/analysis/late_gaps.py: each late TBT gap of a run, matched with the
iteration that produced its second token on the request's worker (inferred
from the token times: the records name no worker per request), and sorted
into planned over / overran / between iterations. Constructed records with a
known answer: two workers whose iterations interleave."""
from __future__ import annotations

from testbed.analysis.late_gaps import late_gaps
from testbed.metrics import IterationRecord, RequestRecord, write_jsonl

LAG = 0.002          # a token reaches the frontend this long after its iteration ended


def _worker(name: str, t0: float, steps: list[tuple[float, float | None, int]]) -> list[IterationRecord]:
    """Back-to-back iterations from t0: (duration, predicted, prefill tokens)."""
    out, t = [], t0
    for duration, predicted, prefill in steps:
        out.append(IterationRecord(t, duration, prefill, 1, worker=name, token_budget=prefill + 1,
                                   predicted_s=predicted))
        t += duration
    return out


def _request(rid: str, its: list[IterationRecord], skip: set[int] = frozenset()) -> RequestRecord:
    """A decode in every iteration of `its` but those in `skip`."""
    times = [it.start_s + it.duration_s + LAG for k, it in enumerate(its) if k not in skip]
    return RequestRecord(rid, "finished", 100, list(range(len(times))), 0.0, first_token_s=times[0],
                         token_times_s=times, finish_s=times[-1])


def test_each_late_gap_is_matched_with_its_iteration_on_the_right_worker_and_sorted_by_cause(tmp_path):
    a = _worker("a", 0.0, [(0.05, 0.05, 0), (0.15, 0.15, 512), (0.05, 0.05, 0), (0.13, 0.08, 256),
                           (0.05, 0.05, 0), (0.06, 0.06, 0)])
    # b's iteration ends fall 10 ms after a's: a request on b must not be matched with a's steps
    b = _worker("b", 0.01, [(0.05, 0.05, 0)] * 6)
    requests = [_request("on-a", a),
                _request("on-b", b, skip={2, 3}),           # sat out two of b's iterations: one 150 ms gap
                _request("unjudged", a)]
    write_jsonl(tmp_path / "iterations.jsonl", a + b)
    write_jsonl(tmp_path / "requests.jsonl", requests)
    g = late_gaps(tmp_path, 0.1, judged={"on-a", "on-b"})
    assert (g["gaps"], g["late"]) == (5 + 3, 3)
    assert [(r["request"], r["worker"], r["prefill_tokens"]) for r in g["planned_over"]] == [("on-a", "a", 512)]
    assert [(r["request"], r["worker"], r["prefill_tokens"], r["predicted_s"]) for r in g["overran"]] == [
        ("on-a", "a", 256, 0.08)]
    assert [(r["request"], r["worker"], r["iterations_in_gap"]) for r in g["between"]] == [("on-b", "b", 3)]
    assert abs(g["between"][0]["gap_s"] - 0.15) < 1e-9
    assert g["iterations"] == 12 and g["iterations_over_target"] == 2
    # every request when none is named judged: the unjudged copy of on-a adds its two late gaps
    assert late_gaps(tmp_path, 0.1)["late"] == 5
