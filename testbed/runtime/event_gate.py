"""EventGate: which events the real frontend takes, judged by who sent them.

Workers and the KV store send events on a DEALER whose ZMQ routing id is their
worker id, to the frontend's ROUTER (testbed/runtime/real.py), so every event
arrives with its sender's identity; ZMQ refuses a second peer that claims an
identity already connected. An event is refused when
  - its sender is not one of the run's workers or its store;
  - its `worker` field (where it has one) names another worker;
  - it is about a request the frontend never sent to that sender (an unknown
    id included). A sender holds a request from the first command that carried
    it there (Add, Prefill, Reserve) on: the prefill worker's last events can
    trail the decode worker's, and late events about a resolved request are
    the controller's to clean up after (a reservation answered after an abort),
    for `grace_s` after the request ended (`retire`; the real runtime gives
    transfer.lease_s, after which a worker frees what it held by itself), and
    then the request is forgotten here too: the gate holds the requests in
    flight and those that ended within grace_s, not every request of the run.
Without runtime.curve any local process can connect; with it only holders of
the run's client key can, so a peer cannot take a worker's identity first."""
from __future__ import annotations

from collections import deque
from typing import Iterable

from testbed.runtime.messages import Command, Event, Tokens
from testbed.wire_text import shown


class EventGate:
    def __init__(self, peers: Iterable[str], grace_s: float = 30.0) -> None:
        self.peers = frozenset(peers)
        self.grace_s = grace_s
        self.sent_to: dict[str, set[str]] = {}    # request id -> workers a command carried it to
        self.retired: deque[tuple[float, str]] = deque()     # (when it ended, request id), oldest first
        self.num_refused = 0

    def retire(self, request_id: str, now: float) -> None:
        """The request ended at `now` (a monotonic clock): its late events pass
        for grace_s more; requests that ended longer ago are forgotten."""
        self.retired.append((now, request_id))
        while self.retired and self.retired[0][0] < now - self.grace_s:
            self.sent_to.pop(self.retired.popleft()[1], None)

    def on_command(self, worker_id: str, msg: Command) -> None:
        req = getattr(msg, "request", None)
        if req is not None:
            self.sent_to.setdefault(req.id, set()).add(worker_id)

    def refusal(self, sender: bytes, ev: Event) -> str | None:
        """Why the event from `sender` (its routing id) is refused (counted), or None."""
        why = self._refusal(sender, ev)
        self.num_refused += why is not None
        return why

    def _refusal(self, sender: bytes, ev: Event) -> str | None:
        name = sender.decode("utf-8", "replace") if sender.isascii() else None
        if name not in self.peers:
            return f"an event '{ev.kind}' from {shown(sender)}, not one of the run's workers"
        claimed = getattr(ev, "worker", name)
        if claimed != name:
            return f"an event '{ev.kind}' from {name} that names worker {shown(claimed)}"
        ids = [item[0] for item in ev.items] if type(ev) is Tokens else [getattr(ev, "id", None)]
        for rid in ids:
            if rid is not None and name not in self.sent_to.get(rid, ()):
                return f"an event '{ev.kind}' from {name} about request {shown(rid)}, which it was never sent"
        return None
