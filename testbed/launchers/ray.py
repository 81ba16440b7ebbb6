"""`launcher=ray`: every worker is a Ray actor, each pool (the workers of one
role) placed by its own placement group: PACK or SPREAD per pool
(`ray.strategy`), pinned to nodes by a custom resource (`ray.resources`).

`ray.address` null starts a local cluster on loopback with the dashboard off,
sized to the workers, inside a private network namespace (netns.py: Ray 2.60
listens on every interface otherwise), and shuts it down in `join`; an
address (or `auto`) joins a running cluster and leaves it running.

An actor builds its worker in `setup`, which returns the worker's endpoints
(its KV receiver address) through Ray, then runs the worker loop in `serve`.
Its KV receiver binds the address of the node it landed on (`_on_node`), so
pools on different nodes reach each other (beyond loopback: runtime.curve).
A service (mode=kvstore's KV store) is an actor too, in a pool of its own,
placed with the workers and started before them: `run` runs its entry,
which announces its address in its Ready event.
A dead actor (killed, its node gone) makes `serve`'s result ready with an
error, so `alive` turns false and the frontend's usual fault handling takes
over, as for a dead process.

Clocks (testbed/clock.py): an actor on a node that runs the frontend's kernel
(the same boot id, which namespaces on one machine share) reads the same
CLOCK_MONOTONIC and takes the frontend's t0 as is; on another machine, the
t0 is shifted by the offset of a round trip at start-up (the midpoint
estimate, off by at most half the round trip)."""
from __future__ import annotations

import os
import socket
import time
from dataclasses import replace

from testbed.data.store import ENV as DATA_ENV
from testbed.launchers.base import Launcher, WorkerSpec
from testbed.launchers.config import RayConfig


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return ""


class _WorkerActor:
    """The actor body (wrapped with ray.remote on use, so importing this module needs no Ray)."""

    def info(self) -> dict:
        import os
        import ray
        return {"pid": os.getpid(), "node_ip": ray.util.get_node_ip_address(), "boot_id": _boot_id()}

    def clock(self) -> float:
        return time.monotonic()

    def setup(self, spec: WorkerSpec) -> dict:
        from testbed.runtime.worker_process import WorkerProcess
        self.worker = WorkerProcess(spec)
        return {"kv_address": self.worker.address}

    def serve(self) -> int:
        self.worker.serve()
        return 0

    def run(self, spec: WorkerSpec) -> int:
        """A service's whole life (the KV store: testbed/runtime/store_process.py), which
        announces its own endpoint in its Ready event."""
        from testbed.launchers.local import run_entry
        run_entry(spec)
        return 0


# an HTTP/2 client's connection preface and an empty SETTINGS frame: a gRPC server (Ray's GCS)
# answers with a SETTINGS frame of its own (RFC 9113, 3.4)
_H2_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
_H2_SETTINGS = 4


def _check_reachable(address: str, timeout_s: float) -> None:
    """ray.address=HOST:PORT must be a Ray head's GCS: Ray itself retries an
    address where nothing listens, or where another server holds the port,
    for minutes, printing GCS time-outs. `auto` and ray:// addresses are
    Ray's to resolve (it says at once when there is none); a TLS cluster
    (RAY_USE_TLS) is not probed in the clear."""
    if address == "auto" or "://" in address:
        return
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"ray.address: '{address}' is not HOST:PORT, 'auto' or ray://HOST:PORT; "
                         "leave it unset to start a local cluster")
    wait_s = min(timeout_s, 10.0)
    try:
        conn = socket.create_connection((host, int(port)), timeout=wait_s)
    except OSError as e:
        raise ValueError(f"ray.address: nothing answers at {address} ({e.strerror or e}); start a cluster there "
                         f"(`ray start --head --port={port}`) or leave ray.address unset for a local one") from None
    if os.environ.get("RAY_USE_TLS", "0").lower() in ("1", "true"):
        conn.close()
        return
    with conn:
        try:
            conn.settimeout(min(wait_s, 5.0))
            conn.sendall(_H2_PREFACE)
            head = conn.recv(9)
        except OSError:
            head = b""
    if len(head) < 4 or head[3] != _H2_SETTINGS:
        raise ValueError(f"ray.address: port {port} on {host} is taken by a process that is not a Ray head (it does "
                         "not answer as Ray's GCS); give the port `ray start --head` printed (6379 by default; not the "
                         f"dashboard's 8265), or free port {port}, or leave ray.address unset for a local cluster")


def connect(address: str | None, host: str, num_cpus: int, private_netns: bool, timeout_s: float,
            num_gpus: int | None = 0, log_to_driver: bool = True) -> bool:
    """ray.init for this process: with no `address` a local cluster of
    `num_cpus` CPUs, its node on `host` (loopback) and the dashboard off, in a
    private loopback-only network namespace first when `private_netns` (Ray
    2.60 listens on every interface otherwise; netns.py); with one ("auto",
    HOST:PORT) that cluster, its address checked first. True when this call
    initialised Ray: ray.shutdown() then stops a local cluster, or leaves a
    joined one. False when Ray was already initialised here."""
    import ray
    if ray.is_initialized():
        return False
    if address is None:
        if private_netns:
            from testbed.launchers.netns import enter_private_netns
            enter_private_netns()
        # every server of the local cluster on loopback, none on the machine's address
        ray.init(address="local", num_cpus=num_cpus, num_gpus=num_gpus, include_dashboard=False,
                 _node_ip_address=host, configure_logging=False, log_to_driver=log_to_driver)
        return True
    _check_reachable(address, timeout_s)
    try:
        ray.init(address=address, include_dashboard=False, configure_logging=False, log_to_driver=log_to_driver)
    except (ConnectionError, ValueError) as e:       # no cluster at "auto", a malformed address
        raise ValueError(f"ray.address: {e}") from None
    return True


class RayLauncher(Launcher):
    name = "ray"

    def __init__(self, cfg) -> None:
        self.cfg: RayConfig = cfg.ray
        self.local_ip = cfg.runtime.host       # the local cluster's node address (loopback by default)
        self.gpus_per_worker = cfg.parallel.tp * cfg.parallel.pp if cfg.device.startswith("cuda") else 0
        self._started_cluster = False
        # actors on a cluster this run joins do not inherit its environment: data.dir goes with them
        self._runtime_env = {"env_vars": {DATA_ENV: cfg.data.dir}} if cfg.data.dir else None
        self._actors: dict = {}
        self._info: dict[str, dict] = {}
        self._setup: dict = {}
        self._serve: dict = {}
        self._exit: dict[str, int] = {}
        self._pgs: list = []
        if self.cfg.resources and self.cfg.address is None:
            # the cluster the run starts has no custom resources: placement would wait start_timeout_s and fail
            role, name = next(iter(self.cfg.resources.items()))
            raise ValueError(f"ray.resources.{role}: '{name}' pins a pool to nodes of a cluster started with "
                             "`ray start --resources`; the local cluster (ray.address unset) has none: "
                             "set ray.address to that cluster")
        if self.cfg.address is None and self.cfg.private_netns:
            from testbed.launchers.netns import enter_private_netns
            enter_private_netns()      # before the frontend binds anything (RealRuntime builds us first)

    # -- placement -------------------------------------------------------------------
    def _init(self, num_workers: int) -> None:
        # the private namespace, if any, was entered in __init__, before the frontend bound anything
        num_cpus = self.cfg.num_cpus or max(1, int(num_workers * self.cfg.actor_cpus + 0.999))
        self._started_cluster = connect(
            self.cfg.address, self.local_ip, num_cpus, private_netns=False, timeout_s=self.cfg.start_timeout_s,
            num_gpus=None if self.gpus_per_worker else 0, log_to_driver=True) and self.cfg.address is None

    def prepare(self, specs: list[WorkerSpec]) -> None:
        import ray
        from ray.util.placement_group import placement_group
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        self._init(len(specs))
        pools: dict[str, list[WorkerSpec]] = {}
        for s in specs:
            pools.setdefault(s.role, []).append(s)
        remote_cls = ray.remote(_WorkerActor)
        for role, members in pools.items():
            bundle = {"CPU": self.cfg.actor_cpus}
            if self.gpus_per_worker:
                bundle["GPU"] = self.gpus_per_worker
            if role in self.cfg.resources:
                bundle[self.cfg.resources[role]] = 0.001
            pg = placement_group([dict(bundle) for _ in members], strategy=self.cfg.strategy_of(role),
                                 name=f"testbed-{role}")
            self._pgs.append(pg)
            if not pg.wait(timeout_seconds=self.cfg.start_timeout_s):
                raise TimeoutError(f"ray: pool '{role}' ({len(members)} x {bundle}, {self.cfg.strategy_of(role)}) "
                                   f"not placeable after {self.cfg.start_timeout_s:.0f} s; "
                                   f"cluster resources {ray.cluster_resources()}")
            for i, s in enumerate(members):
                self._actors[s.worker_id] = remote_cls.options(
                    num_cpus=self.cfg.actor_cpus, num_gpus=self.gpus_per_worker, max_restarts=0,
                    runtime_env=self._runtime_env,
                    scheduling_strategy=PlacementGroupSchedulingStrategy(pg, placement_group_bundle_index=i),
                ).remote()
        infos = ray.get([a.info.remote() for a in self._actors.values()], timeout=self.cfg.start_timeout_s)
        self._info = dict(zip(self._actors, infos))

    def node_ip(self, worker_id: str) -> str:
        return self._info[worker_id]["node_ip"]

    def _on_node(self, worker_id: str, cfg: dict) -> dict:
        """The worker's config with its KV receiver (and gloo) bound on its own node's address
        (the one Ray knows the node by), wherever transfer.host pointed: one value cannot
        name an address on every node. On a one-node cluster that is runtime.host's."""
        transfer = cfg.get("transfer")
        if not transfer:
            return cfg
        return {**cfg, "transfer": {**transfer, "host": self.node_ip(worker_id)}}

    def _t0(self, worker_id: str, t0: float) -> float:
        import ray
        if self._info[worker_id]["boot_id"] == _boot_id() != "":
            return t0                  # one kernel, one CLOCK_MONOTONIC
        a = time.monotonic()
        remote = ray.get(self._actors[worker_id].clock.remote())
        b = time.monotonic()
        return t0 + (remote - (a + b) / 2)

    # -- the Launcher interface ---------------------------------------------------------
    def start(self, spec: WorkerSpec) -> None:
        service = spec.entry != WorkerSpec.entry
        if spec.worker_id not in self._actors:
            self.prepare([spec])
        actor = self._actors[spec.worker_id]
        spec = replace(spec, t0=self._t0(spec.worker_id, spec.t0), cfg=self._on_node(spec.worker_id, spec.cfg))
        if service:
            self._serve[spec.worker_id] = actor.run.remote(spec)
            return
        self._setup[spec.worker_id] = actor.setup.remote(spec)
        self._serve[spec.worker_id] = actor.serve.remote()

    def _result(self, worker_id: str) -> int | None:
        import ray
        if worker_id in self._exit:
            return self._exit[worker_id]
        ref = self._serve.get(worker_id)
        if ref is None:
            return None
        ready, _ = ray.wait([ref], timeout=0)
        if not ready:
            return None
        try:
            code = ray.get(ref)
        except ray.exceptions.RayActorError:
            code = -9                  # the actor (or its node) died
        except ray.exceptions.RayError:
            code = 1                   # the worker raised (it reported a WorkerError first)
        self._exit[worker_id] = code
        return code

    def alive(self, worker_id: str) -> bool:
        return worker_id in self._serve and self._result(worker_id) is None

    def exit_code(self, worker_id: str) -> int | None:
        return self._result(worker_id)

    def pid(self, worker_id: str) -> int | None:
        return self._info[worker_id]["pid"] if worker_id in self._info else None

    def kv_address(self, worker_id: str, announced: str) -> str:
        import ray
        return ray.get(self._setup[worker_id], timeout=self.cfg.start_timeout_s)["kv_address"]

    def kill(self, worker_id: str) -> None:
        import ray
        ray.kill(self._actors[worker_id], no_restart=True)
        deadline = time.monotonic() + 5
        while self.alive(worker_id) and time.monotonic() < deadline:
            time.sleep(0.01)

    def join(self, timeout_s: float) -> None:
        import ray
        if not ray.is_initialized():
            return
        try:
            refs = list(self._serve.values())
            if refs:
                ray.wait(refs, num_returns=len(refs), timeout=max(0.0, timeout_s))
            for wid, actor in self._actors.items():
                self._result(wid)
                ray.kill(actor, no_restart=True)
            from ray.util.placement_group import remove_placement_group
            for pg in self._pgs:
                remove_placement_group(pg)
        finally:
            self._actors.clear()
            self._pgs.clear()
            ray.shutdown()         # a cluster this launcher started stops with it
