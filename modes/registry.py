"""Modes and worker roles by name (DESIGN.md, "Modes").

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
from dataclasses import dataclass
from typing import ClassVar

from testbed.modes.base import ModeController, Send, WorkerInfo
from testbed.modes.colocated import ColocatedController
from testbed.modes.disagg import DisaggController
from testbed.modes.disagg_roles import DecodeWorker, PrefillWorker
from testbed.modes.routers import make_router
from testbed.worker import WorkerService


@dataclass(frozen=True)
class ModeSettings:
    """The part of the run config a mode reads."""
    replicas: int
    prefill_workers: int
    decode_workers: int
    router: str
    prefill_router: str
    decode_router: str
    num_kv_blocks: int
    block_size: int


class Mode(ABC):
    name: ClassVar[str]
    needs_kv_port: ClassVar[bool] = False     # its workers move KV between them

    def __init__(self, settings: ModeSettings):
        self.settings = settings

    @abstractmethod
    def layout(self) -> list[tuple[str, str]]:
        """(worker id, role) of every worker, in rank order."""

    @abstractmethod
    def controller(self, workers: list[WorkerInfo], send: Send, copy_prompts: bool) -> ModeController:
        """The frontend's controller over `workers` (layout() as WorkerInfos)."""

    def workers(self) -> list[WorkerInfo]:
        s = self.settings
        return [WorkerInfo(w, role, s.num_kv_blocks, s.block_size) for w, role in self.layout()]


class ColocatedMode(Mode):
    name = "colocated"

    def layout(self):
        return [(f"replica{i}", "colocated") for i in range(self.settings.replicas)]

    def controller(self, workers, send, copy_prompts):
        return ColocatedController(workers, send, make_router(self.settings.router, "router"), copy_prompts)


class DisaggMode(Mode):
    name = "disagg"
    needs_kv_port = True

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


MODES: dict[str, type[Mode]] = {}
ROLES: dict[str, type[WorkerService]] = {}


def register_mode(cls: type[Mode]) -> type[Mode]:
    MODES[cls.name] = cls
    return cls


def register_role(cls: type[WorkerService]) -> type[WorkerService]:
    ROLES[cls.role] = cls
    return cls


for _mode in (ColocatedMode, DisaggMode):
    register_mode(_mode)
for _role in (WorkerService, PrefillWorker, DecodeWorker):
    register_role(_role)


def get_mode(name: str, settings: ModeSettings) -> Mode:
    if name not in MODES:
        raise ValueError(f"mode='{name}' is not known; choose one of: {', '.join(sorted(MODES))}")
    return MODES[name](settings)


def get_role(name: str) -> type[WorkerService]:
    if name not in ROLES:
        raise ValueError(f"worker role '{name}' is not known; choose one of: {', '.join(sorted(ROLES))}")
    return ROLES[name]
