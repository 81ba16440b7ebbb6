"""WorkerService: an engine that takes frontend commands and emits events
(testbed/runtime/messages.py). This class is the colocated worker: it
prefills and decodes its own requests. A mode's other roles subclass it
(modes/disagg_roles.py, modes/kvstore_roles.py) and say, as class
attributes, what their engine is built with, so that neither the runtimes
nor this class test a role's name.

The real runtime runs one per process and moves the messages over ZMQ; the
simulator calls the same methods in virtual-time order. Neither the engine nor
the scheduler knows which."""
from __future__ import annotations

from typing import Callable, ClassVar

from testbed.batch import Batch
from testbed.engine import Engine, StepOutput
from testbed.request import RequestStatus
from testbed.runtime.kv_port import KVPort
from testbed.runtime.messages import (Abort, Add, Command, Connect, Event, ExpectSenders, Finished, IterationDone,
                                      Ping, Pong, Preempted, Release, Stats, Stop, Tokens)
from testbed.runtime.store_port import StorePort

Emit = Callable[[Event], None]
# a step's call into the engine: Engine.step, or a runtime's own path (None: it ran nothing)
EngineStep = Callable[[Engine, Callable[[int, Batch], None] | None], StepOutput | None]


class WorkerService:
    role: ClassVar[str] = "colocated"
    prefill_only: ClassVar[bool] = False      # the engine hands requests off after their first token
    prefix_caching: ClassVar[bool] = True     # its block manager hashes prompt blocks for reuse
    sends_kv: ClassVar[bool] = False          # it learns its KV peers' addresses (Connect) and sends KV
    receives_kv: ClassVar[bool] = False       # it binds a KV receiver whose address it reports
    uses_store: ClassVar[bool] = False        # it reads and writes the shared KV store (mode=kvstore)
    # the RunConfig section (testbed/pool_config.py) whose parallel config it runs with; None: the run's
    pool: ClassVar[str | None] = None

    def __init__(self, worker_id: str, engine: Engine, emit: Emit, kv_port: KVPort | None = None,
                 layerwise: bool = False, store: StorePort | None = None):
        self.worker_id, self.engine, self.emit = worker_id, engine, emit
        self.kv_port, self.layerwise, self.store = kv_port, layerwise, store
        self.stopping = False
        self.num_leases_expired = 0
        self._handlers: dict[type[Command], Callable] = {
            Add: lambda m: self.engine.add_request(m.request.to_request()),
            Release: lambda m: self._release(m.id),
            Abort: lambda m: self._abort(m.id),
            Connect: lambda m: self.kv_port.connect(m.peer, m.address),
            ExpectSenders: lambda m: self.kv_port.expect_senders(m.senders),
            Stop: self._stop,
            Ping: self._ping,
        }

    # -- commands ----------------------------------------------------------
    def handle(self, msg: Command) -> None:
        handler = self._handlers.get(type(msg))
        if handler is None:
            raise ValueError(f"a {self.role} worker takes no '{msg.kind}' command")
        handler(msg)

    def _stop(self, msg: Stop) -> None:
        self.stopping = True

    def _ping(self, msg: Ping) -> None:
        self.renew_leases(msg.held, self.engine.clock.now())
        self.emit(Pong(self.worker_id))

    def _release(self, request_id: str) -> None:
        """Free the KV blocks of a request that left the scheduler."""
        self.engine.release(request_id)

    def _holds(self, request_id: str) -> bool:
        """Whether the worker holds blocks for a request outside its scheduler."""
        return False

    def _abort(self, request_id: str) -> None:
        req = self.engine.abort(request_id)
        held = self._holds(request_id)
        self._release(request_id)
        if req is not None or held:
            self.emit(Finished.failed(request_id, "aborted by the client", RequestStatus.ABORTED))

    # -- the loop body -------------------------------------------------------
    def has_work(self) -> bool:
        return self.engine.has_work()

    def awaits_kv(self) -> bool:
        """Blocks are reserved for KV still on its way (the loop polls faster)."""
        return False

    def expire_leases(self, now: float, lease_s: float) -> None:
        """Free blocks held for a hand-off whose acknowledgement is older than
        `lease_s` (transfer.lease_s). Only the real runtime's loop calls it: a
        message is lost only on a real wire."""

    def renew_leases(self, request_ids: list[str], now: float) -> None:
        """The frontend still counts on these requests (its heartbeat says so):
        what is held for them is waiting, not lost, and its lease starts over."""

    def _layer_hook(self) -> Callable[[int, Batch], None] | None:
        return None

    def _before_step(self) -> None:
        pass

    def _after_finished(self, out: StepOutput) -> None:
        """Between the step's `finished` events and its `preempted` ones."""

    def step(self, run: EngineStep = Engine.step) -> StepOutput | None:
        """One iteration, or None where `run` ran nothing."""
        self._before_step()
        out = run(self.engine, self._layer_hook())
        if out is not None:
            self._emit_step(out)
        return out

    def _emit_step(self, out: StepOutput) -> None:
        now = out.end_s
        if out.new_tokens:
            # the token's index: a request's tokens come from two workers in disagg
            self.emit(Tokens(self.worker_id, [(r.request_id, tok, now, r.num_output_tokens - 1)
                                              for r, tok in out.new_tokens]))
        for req in out.finished:
            self._forget(req.request_id)
            self.emit(Finished.of(req))
        self._after_finished(out)
        for req in out.preempted:
            self.emit(Preempted(req.request_id))
        out.iteration.worker = self.worker_id
        self.emit(IterationDone(out.iteration, self.engine.bm.num_free_blocks))

    def _forget(self, request_id: str) -> None:
        """A request finished in this step: drop the role's state for it."""

    def stats(self) -> Stats:
        bm = self.engine.bm
        return Stats(self.worker_id, self.role, bm.num_free_blocks, bm.num_blocks, bm.all_free(),
                     self.engine.scheduler.num_preemptions, self.num_leases_expired,
                     **(self.kv_port.stats() if self.kv_port is not None else {}))
