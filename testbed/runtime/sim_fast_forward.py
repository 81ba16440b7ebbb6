"""What a scheduler or a mode controller may implement, beside its own code,
to let `runtime=sim` fast-forward (`runtime.sim_fast_forward`): run a worker's
iterations ahead of the event loop, and its steady decode iterations as one
`DecodeRun` (testbed/runtime/sim_decode_run.py). The core contracts
(`Engine.step`, `Scheduler.schedule` / `on_step`, `ModeController`) know
nothing of it; a policy that implements none of it simulates iteration by
iteration, with the same records."""
from __future__ import annotations

from collections.abc import Iterator
from typing import Protocol, runtime_checkable

from testbed.request import Request


@runtime_checkable
class SteadyDecodes(Protocol):
    """A scheduler whose next batch may be one decode of each running
    request, and which can say so without building the Batch."""

    # observe_steady must be called for each such batch (a policy that plans every batch)
    observes_steady: bool

    def steady_decodes(self) -> tuple[list[Request], int | None] | None:
        """When schedule() would return only one decode of each running
        request (in running order): those requests, their KV grown as
        schedule() grows it, and the batch's token_budget. None, changing
        nothing, when the next iteration may be anything else (a prompt to
        schedule, a preemption). After such a batch ran, the answer is the
        same requests again unless one of them now starts a KV block or the
        queues changed: a decode run asks again only then."""

    def observe_steady(self, num_decodes: int, context_tokens: int, longest_context: int,
                       start_s: float, end_s: float) -> float | None:
        """A steady decode batch ran from `start_s` to `end_s` (the clock may
        stand elsewhere: a decode run observes its iterations before it moves
        the clock past them): what schedule() and on_step would have done
        with it. `context_tokens` is the sum of the decodes' contexts after
        the step, `longest_context` the longest. Returns the batch's
        predicted_s (None: none)."""


@runtime_checkable
class PlansArrivals(Protocol):
    """A controller that sends commands on arrivals alone
    (commands_on_events False) and can say where the next ones go: a worker
    runs ahead up to the first arrival planned for it."""

    def planned_targets(self, upcoming: list[Request]) -> Iterator[str]:
        """The worker each of the `upcoming` arrivals (in arrival order, none
        arrived yet) will be sent to, "" for one that ends at its arrival;
        stops at the first it cannot say."""


@runtime_checkable
class ShowsApart(Protocol):
    """A controller that answers events with commands, and can say whose
    events cannot reach a worker: that worker's steady decodes run past
    them as one DecodeRun."""

    def apart_from(self, worker_id: str) -> frozenset[str] | None:
        """The workers whose events, from now until the next arrival, can
        neither reach `worker_id` (a command, KV), nor make the controller
        read its state, nor give work to a worker outside them that has none.
        None: not known now (the worker then stops at every event)."""
