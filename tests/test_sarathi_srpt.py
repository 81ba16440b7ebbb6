"""scheduler=sarathi_srpt: sarathi's decode-first batching with the chunks
given shortest-remaining-prompt-first. Exact slices on the tiny model: a short
prompt arriving while a long one is chunking goes first and the long one gets
the rest of the budget; the tokens are sarathi's (fp32, greedy, exact) and
every block comes back. (test_engine's scheduler-parametrized tests cover it
too: same tokens as every request alone, budget respected, preemption.)"""
from __future__ import annotations

from test_engine import Harness, assert_same_outputs, prompt
from testbed.request import Request


def _run_with_a_late_short_prompt(scheduler: str):
    """A 20-token prompt alone for one iteration, then a 3-token one arrives."""
    h = Harness(scheduler, token_budget=8)
    slices: list[list[tuple[str, int]]] = []
    schedule = h.scheduler.schedule

    def spy():
        batch = schedule()
        slices.append([(s.request.request_id, s.num_tokens) for s in batch.slices])
        return batch
    h.scheduler.schedule = spy
    long, short = Request("long", prompt(20, seed=7), 3), Request("short", prompt(3, seed=8), 3)
    h.engine.add_request(long)
    h.step()
    h.engine.add_request(short)
    while h.engine.has_work():
        h.step()
    h.bm.check_invariants()
    assert h.bm.all_free()
    return h.run_, slices


def test_a_short_prompt_goes_ahead_of_a_long_one_already_chunking():
    srpt, srpt_slices = _run_with_a_late_short_prompt("sarathi_srpt")
    fcfs, fcfs_slices = _run_with_a_late_short_prompt("sarathi")
    assert fcfs_slices[:3] == [[("long", 8)], [("long", 8)], [("long", 4), ("short", 3)]]
    # the short prompt is whole in the next iteration (its first token), the long one fills the budget
    assert srpt_slices[:3] == [[("long", 8)], [("short", 3), ("long", 5)], [("short", 1), ("long", 7)]]
    assert srpt_slices[3] == [("long", 1), ("short", 1)]          # both decode now, in running order
    assert_same_outputs(srpt, fcfs, ["long", "short"])
