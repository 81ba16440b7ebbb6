"""Per-token deadlines of running requests in the fluidity-index view
(Etalon; testbed.metrics.fluidity_deadlines measures the same thing after the
run): token k of a request is due at its anchor + (k - anchor index) · TBT,
the anchor being its first token. A token that meets its deadline early banks
the difference as slack for later tokens; a missed one moves the anchor to
itself, so deadlines count again from there. The adaptive scheduler reads
each decode's slack before choosing an iteration's budget.

State is kept per request and advanced over the tokens sampled since the last
look (usually one), so a look costs O(1) per decode."""
from __future__ import annotations

from testbed.request import Request

_EPS_S = 1e-9     # as metrics: a token exactly on its deadline meets it


class TokenDeadlines:
    def __init__(self, tbt_s: float):
        self.tbt_s = tbt_s
        self._state: dict[str, list] = {}         # request id -> [anchor_s, anchor_index, checked_index]

    def slack_s(self, req: Request) -> float:
        """Seconds the request's next token may come later than one TBT after its
        last one and still meet its deadline (0 when the request runs late)."""
        times = req.token_times_s
        last = len(times) - 1
        st = self._state.get(req.request_id)
        if st is None:
            st = self._state[req.request_id] = [times[0], 0, 0]
        anchor_s, anchor_k, checked = st
        tbt = self.tbt_s
        while checked < last:
            checked += 1
            if times[checked] > anchor_s + (checked - anchor_k) * tbt + _EPS_S:
                anchor_s, anchor_k = times[checked], checked
        st[0], st[1], st[2] = anchor_s, anchor_k, checked
        return anchor_s + (last + 1 - anchor_k) * tbt - times[last] - tbt

    def forget(self, request_id: str) -> None:
        self._state.pop(request_id, None)
