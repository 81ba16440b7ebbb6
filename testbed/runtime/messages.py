"""Messages between the frontend (mode controller) and workers: one small
dataclass per kind (README.md, "Architecture").

The simulator hands these objects over in virtual-time order; the real runtime
sends them over ZMQ in their one msgpack encoding (testbed/runtime/wire.py,
never pickle). A request rides in a command as a `RequestMsg`.

frontend -> worker: Add, Prefill, Reserve, Release, Abort, Connect, ExpectSenders, Stop, Ping
worker -> frontend: Ready; Tokens (items (id, token, engine_s, index): a disagg
    request's first token and the rest come from two workers on two sockets,
    the index restores their order); Finished (also failed and aborted
    requests); Preempted; IterationDone (one per engine step, with the worker's
    free KV blocks); FreeBlocks (a decode worker freed blocks outside a step);
    Reserved / Rejected; Prefilled; KVReceived; Stats (at stop); WorkerError;
    Pong (the answer to a Ping, the frontend's heartbeat); Busy (alive inside
    a long step, runtime/step_watch.py)
mode=kvstore adds: PrefixFetched (a prefill worker found a prompt's cached
    prefix, locally and in the store); StoreStats (the store process, at stop)
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Sequence

from testbed.kv_transfer.store_index import StoreCounters
from testbed.metrics import IterationRecord
from testbed.request import Request, RequestStatus, SamplingParams


@dataclass(slots=True)
class RequestMsg:
    """A request's fields as they travel; `prompt` is a list of token ids on
    the wire, or the request's own (possibly lazy) prompt in the simulator."""
    id: str
    prompt: Sequence[int]
    max_tokens: int
    arrival_s: float
    temperature: float
    top_p: float
    seed: int
    ignore_eos: bool
    eos: int | None
    private_from: int | None = None

    def to_request(self) -> Request:
        return Request(self.id, self.prompt, self.max_tokens, self.arrival_s,
                       SamplingParams(self.temperature, self.top_p, self.seed, self.ignore_eos, self.eos),
                       private_from=self.private_from)


def request_to_msg(req: Request, copy_prompt: bool = True) -> RequestMsg:
    """`copy_prompt=False` passes the prompt as it is: the simulator's workers
    live in the frontend's process and never mutate it, and a lazy 1M-token
    prompt is never copied."""
    sp = req.sampling
    prompt = list(req.prompt_token_ids) if copy_prompt else req.prompt_token_ids
    return RequestMsg(req.request_id, prompt, req.max_tokens, req.arrival_s, sp.temperature, sp.top_p,
                      sp.seed, sp.ignore_eos, sp.eos_token_id, req.private_from)


@dataclass(slots=True)
class HandOffMeta:
    """What the decode worker needs of a request's prefill, riding with its
    last KV payload (as `to_dict()`; read back by wire.hand_off_meta): the
    first token and when it was sampled."""
    first_token: int
    first_token_s: float
    last_iteration_s: float           # the final prefill iteration's duration (layer-wise timing)
    first_scheduled_s: float | None
    num_preemptions: int

    def to_dict(self) -> dict:
        return {"first_token": self.first_token, "first_token_s": self.first_token_s,
                "last_iteration_s": self.last_iteration_s, "first_scheduled_s": self.first_scheduled_s,
                "num_preemptions": self.num_preemptions}


class Message:
    """A command or an event; `kind` is its tag on the wire."""
    kind: ClassVar[str]


class Command(Message):
    pass


class Event(Message):
    pass


# -- frontend -> worker ----------------------------------------------------------------
@dataclass(slots=True)
class Add(Command):
    kind: ClassVar[str] = "add"
    request: RequestMsg


@dataclass(slots=True)
class Prefill(Command):
    """Prefill the prompt, then send its KV into `dst_blocks` of `peer`."""
    kind: ClassVar[str] = "prefill"
    request: RequestMsg
    peer: str
    dst_blocks: list[int]


@dataclass(slots=True)
class Reserve(Command):
    kind: ClassVar[str] = "reserve"
    request: RequestMsg


@dataclass(slots=True)
class Release(Command):
    kind: ClassVar[str] = "release"
    id: str


@dataclass(slots=True)
class Abort(Command):
    kind: ClassVar[str] = "abort"
    id: str


@dataclass(slots=True)
class Connect(Command):
    kind: ClassVar[str] = "connect"
    peer: str
    address: str


@dataclass(slots=True)
class ExpectSenders(Command):
    """To a worker that receives KV: the names of the run's KV senders; its
    receiver refuses payloads from anyone else."""
    kind: ClassVar[str] = "expect_senders"
    senders: list[str]


@dataclass(slots=True)
class Stop(Command):
    kind: ClassVar[str] = "stop"


@dataclass(slots=True)
class Ping(Command):
    """The frontend's heartbeat (runtime.heartbeat_s); the first also wakes the
    ROUTER's route to a worker at start-up. A worker answers Pong. `held`: the
    requests the frontend still counts on this worker for; what the worker
    holds for one of them is not a lost hand-off, so its lease starts over."""
    kind: ClassVar[str] = "ping"
    held: list[str] = field(default_factory=list)


# -- worker -> frontend ----------------------------------------------------------------
@dataclass(slots=True)
class Ready(Event):
    kind: ClassVar[str] = "ready"
    worker: str
    kv_address: str


@dataclass(slots=True)
class Tokens(Event):
    kind: ClassVar[str] = "tokens"
    worker: str
    items: list[tuple[str, int, float, int]]     # (request id, token, engine time, token index)


@dataclass(slots=True)
class Finished(Event):
    kind: ClassVar[str] = "finished"
    id: str
    status: str
    error: str | None
    finish_s: float | None
    first_scheduled_s: float | None
    num_preemptions: int

    @classmethod
    def of(cls, req: Request) -> Finished:
        return cls(req.request_id, req.status.value, req.error, req.finish_s, req.first_scheduled_s,
                   req.num_preemptions)

    @classmethod
    def failed(cls, req_id: str, error: str, status: RequestStatus = RequestStatus.FAILED) -> Finished:
        return cls(req_id, status.value, error, None, None, 0)


@dataclass(slots=True)
class Preempted(Event):
    kind: ClassVar[str] = "preempted"
    id: str


@dataclass(slots=True)
class IterationDone(Event):
    kind: ClassVar[str] = "iteration"
    record: IterationRecord
    free_blocks: int

    @property
    def worker(self) -> str:
        return self.record.worker


@dataclass(slots=True)
class FreeBlocks(Event):
    kind: ClassVar[str] = "free_blocks"
    worker: str
    free_blocks: int


@dataclass(slots=True)
class Reserved(Event):
    kind: ClassVar[str] = "reserved"
    id: str
    worker: str
    blocks: list[int]
    free_blocks: int


@dataclass(slots=True)
class Rejected(Event):
    kind: ClassVar[str] = "rejected"
    id: str
    worker: str
    free_blocks: int


@dataclass(slots=True)
class Prefilled(Event):
    """The prompt's KV left the prefill worker at engine time `t` (the first
    token's); layer-wise, the transfer began at `transfer_start_s`."""
    kind: ClassVar[str] = "prefilled"
    id: str
    worker: str
    t: float
    kv_bytes: int
    transfer_start_s: float


@dataclass(slots=True)
class KVReceived(Event):
    kind: ClassVar[str] = "kv_received"
    id: str
    worker: str
    t: float


@dataclass(slots=True)
class Stats(Event):
    kind: ClassVar[str] = "stats"
    worker: str
    role: str
    num_free_blocks: int
    num_blocks: int
    all_free: bool
    num_preemptions: int
    num_leases_expired: int = 0     # hand-offs whose blocks were freed by transfer.lease_s, no ack
    # KV port (runtime/kv_port.py): the most KV bytes in flight to one peer, sends that waited
    # for a peer's window, payloads refused (a stranger's, or with no reservation)
    kv_peak_inflight_bytes: int = 0
    kv_sends_waited: int = 0
    kv_refused: int = 0

    def to_dict(self) -> dict:
        return {"worker": self.worker, "role": self.role, "num_free_blocks": self.num_free_blocks,
                "num_blocks": self.num_blocks, "all_free": self.all_free, "num_preemptions": self.num_preemptions,
                "num_leases_expired": self.num_leases_expired, "kv_peak_inflight_bytes": self.kv_peak_inflight_bytes,
                "kv_sends_waited": self.kv_sends_waited, "kv_refused": self.kv_refused}


@dataclass(slots=True)
class PrefixFetched(Event):
    """A kvstore prefill worker's cached prefix of a prompt: `local_tokens`
    from its own cache, then `store_tokens` read from the store in `fetch_s`
    (of `found_tokens` the lookup found; fewer arrive when a block was evicted
    after the lookup, was corrupted, or the store died)."""
    kind: ClassVar[str] = "prefix_fetched"
    id: str
    worker: str
    local_tokens: int
    store_tokens: int
    found_tokens: int
    fetch_s: float


@dataclass(slots=True)
class StoreStats(Event):
    """The KV store's counters, sent by the store process when told to stop."""
    kind: ClassVar[str] = "store_stats"
    worker: str
    counters: StoreCounters
    num_blocks: int
    used_bytes: int
    capacity_bytes: int | None

    def to_dict(self) -> dict:
        return {**self.counters.to_dict(), "num_blocks": self.num_blocks, "used_bytes": self.used_bytes,
                "capacity_bytes": self.capacity_bytes}


@dataclass(slots=True)
class Pong(Event):
    """A worker's answer to Ping: it is still taking commands between steps."""
    kind: ClassVar[str] = "pong"
    worker: str


@dataclass(slots=True)
class Busy(Event):
    """A worker inside a step that is still computing, `step_s` into it
    (runtime/step_watch.py): alive, though it reads no Ping until the step ends."""
    kind: ClassVar[str] = "busy"
    worker: str
    step_s: float


@dataclass(slots=True)
class WorkerError(Event):
    """A worker crashed (or failed to start)."""
    kind: ClassVar[str] = "error"
    worker: str
    error: str
    traceback: str = ""


MESSAGES: dict[str, type[Message]] = {cls.kind: cls for cls in (
    Add, Prefill, Reserve, Release, Abort, Connect, ExpectSenders, Stop, Ping,
    Ready, Tokens, Finished, Preempted, IterationDone, FreeBlocks, Reserved, Rejected, Prefilled, KVReceived,
    Stats, WorkerError, PrefixFetched, StoreStats, Pong, Busy)}

