"""Modes and worker roles by name (README, "Architecture").

A `Mode` declares its worker layout (ids and roles, from `ModeSettings`),
builds its controller, and says whether its workers need a KV port. The
runtimes look a mode up here and never test its name; adding a mode is one
file in modes/ that calls `register_mode`, plus its config.

A role names the WorkerService class a worker runs (testbed/worker.py): the
class says what its engine is built with. Worker processes receive the role's
name and the KV-port flag in their spec, so a mode registered only in the
frontend's process (a test's toy mode, say) still runs on runtime=real as
long as its roles are registered here."""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Mapping

from testbed.kv_transfer.store_config import KVStoreConfig
from testbed.modes.base import ModeController, Send, WorkerInfo
from testbed.modes.cache_aware import PrefixPool, TTFTEstimator
from testbed.modes.colocated import ColocatedController
from testbed.modes.disagg import DisaggController
from testbed.modes.disagg_roles import DecodeWorker, PrefillWorker
from testbed.modes.hybrid import HybridController
from testbed.modes.hybrid_router import make_hybrid_router
from testbed.modes.kvstore import KVStoreController
from testbed.modes.kvstore_roles import KVStorePrefillWorker
from testbed.modes.routers import RouterContext, make_router
from testbed.worker import WorkerService


@dataclass(frozen=True)
class ModeSettings:
    """The part of the run config a mode reads. A field named as a RunConfig
    field holds the run's value (runtime/deployment.py copies those by name);
    the others are derived from the run config there."""
    replicas: int
    prefill_workers: int
    decode_workers: int
    router: str
    prefill_router: str
    decode_router: str
    num_kv_blocks: int
    block_size: int
    # mode=kvstore
    kvstore: KVStoreConfig | None = None
    slo_ttft_ms: float | None = None
    kv_bytes_per_token: int = 0
    router_context: Callable[[], RouterContext] | None = None    # built only for a router that needs it
    # KV blocks of a worker of each pool with its own parallel config (WorkerService.pool), if not num_kv_blocks
    pool_kv_blocks: Mapping[str, int] = field(default_factory=dict)
    # mode=hybrid: its colocated pool, and its threshold (resolved when first asked: auto reads a file)
    colocated_replicas: int = 1
    hybrid_router: str = "length_threshold"
    hybrid_threshold: Callable[[], int] | None = None
    max_model_len: int | None = None     # WorkerInfo.max_model_len of every worker


class Mode(ABC):
    name: ClassVar[str]
    needs_kv_port: ClassVar[bool] = False     # its workers move KV between them
    needs_store: ClassVar[bool] = False       # a KV store service runs beside its workers
    # the pools its workers' roles come from (WorkerService.pool; None: the run's own `parallel`)
    pools: ClassVar[tuple[str | None, ...]] = (None,)

    def __init__(self, settings: ModeSettings):
        self.settings = settings

    @abstractmethod
    def layout(self) -> list[tuple[str, str]]:
        """(worker id, role) of every worker, in rank order."""

    @abstractmethod
    def controller(self, workers: list[WorkerInfo], send: Send, copy_prompts: bool) -> ModeController:
        """The frontend's controller over `workers` (layout() as WorkerInfos)."""

    def check(self) -> None:
        """Resolve and check what the mode reads before any worker starts (a mode's errors at start-up)."""

    def workers(self) -> list[WorkerInfo]:
        s = self.settings
        return [WorkerInfo(w, role, s.pool_kv_blocks.get(get_role(role).pool, s.num_kv_blocks), s.block_size,
                           s.max_model_len)
                for w, role in self.layout()]


class ColocatedMode(Mode):
    name = "colocated"

    def layout(self):
        return [(f"replica{i}", "colocated") for i in range(self.settings.replicas)]

    def controller(self, workers, send, copy_prompts):
        return ColocatedController(workers, send, make_router(self.settings.router, "router"), copy_prompts)


class DisaggMode(Mode):
    name = "disagg"
    needs_kv_port = True
    pools = ("prefill", "decode")

    def layout(self):
        s = self.settings
        return ([(f"prefill{i}", "prefill") for i in range(s.prefill_workers)]
                + [(f"decode{i}", "decode") for i in range(s.decode_workers)])

    def controller(self, workers, send, copy_prompts):
        s = self.settings
        by_role = {role: [w for w in workers if w.role == role] for role in ("prefill", "decode")}
        return DisaggController(by_role["prefill"], by_role["decode"], send,
                                make_router(s.prefill_router, "prefill_router"),
                                make_router(s.decode_router, "decode_router"), copy_prompts)


class KVStoreMode(DisaggMode):
    name = "kvstore"
    needs_store = True

    def layout(self):
        return [(w, "kvstore_prefill" if role == "prefill" else role) for w, role in super().layout()]

    def controller(self, workers, send, copy_prompts):
        s = self.settings
        kv = s.kvstore or KVStoreConfig()
        prefill = [w for w in workers if w.role == "kvstore_prefill"]
        decode = [w for w in workers if w.role == "decode"]
        pool = PrefixPool({w.worker_id: w.num_blocks for w in workers}, s.block_size, kv.capacity_bytes,
                          s.kv_bytes_per_token * s.block_size)
        estimator = TTFTEstimator(s.router_context()) if kv.early_rejection else None
        return KVStoreController(prefill, decode, send,
                                 make_router(kv.prefill_router, "kvstore.prefill_router", s.router_context),
                                 make_router(s.decode_router, "decode_router"), pool, estimator, s.slo_ttft_ms,
                                 copy_prompts)


class HybridMode(DisaggMode):
    """A colocated pool beside P/D pools (modes/hybrid.py)."""
    name = "hybrid"
    pools = (None, "prefill", "decode")

    def layout(self):
        return [(f"replica{i}", "colocated") for i in range(self.settings.colocated_replicas)] + super().layout()

    def check(self) -> None:
        self.threshold()

    def threshold(self) -> int:
        if self.settings.hybrid_threshold is None:
            raise ValueError("mode=hybrid: no hybrid.threshold given")
        return self.settings.hybrid_threshold()

    def controller(self, workers, send, copy_prompts):
        s = self.settings
        by_role = {role: [w for w in workers if w.role == role] for role in ("colocated", "prefill", "decode")}
        return HybridController(by_role["colocated"], by_role["prefill"], by_role["decode"], send,
                                make_hybrid_router(s.hybrid_router, self.threshold()),
                                make_router(s.router, "router"), make_router(s.prefill_router, "prefill_router"),
                                make_router(s.decode_router, "decode_router"), copy_prompts)


MODES: dict[str, type[Mode]] = {}
ROLES: dict[str, type[WorkerService]] = {}


def register_mode(cls: type[Mode]) -> type[Mode]:
    MODES[cls.name] = cls
    return cls


def register_role(cls: type[WorkerService]) -> type[WorkerService]:
    ROLES[cls.role] = cls
    return cls


for _mode in (ColocatedMode, DisaggMode, KVStoreMode, HybridMode):
    register_mode(_mode)
for _role in (WorkerService, PrefillWorker, DecodeWorker, KVStorePrefillWorker):
    register_role(_role)


def get_mode(name: str, settings: ModeSettings) -> Mode:
    if name not in MODES:
        raise ValueError(f"mode='{name}' is not known; choose one of: {', '.join(sorted(MODES))}")
    return MODES[name](settings)


def get_role(name: str) -> type[WorkerService]:
    if name not in ROLES:
        raise ValueError(f"worker role '{name}' is not known; choose one of: {', '.join(sorted(ROLES))}")
    return ROLES[name]
