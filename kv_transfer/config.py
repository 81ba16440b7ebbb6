"""TransferConfig: how a disaggregated worker moves KV to its peer (the
`transfer:` group of the run config). The registry (kv_transfer/registry.py)
reads `transport` to pick the sender and receiver classes; everything else is
a parameter of those classes. Plain types only, so Hydra can set every field."""
from __future__ import annotations

from dataclasses import dataclass

MiB = 1 << 20

TRANSPORTS = ("zmq", "torch_dist", "shaped")
REAL_TRANSPORTS = ("zmq", "torch_dist")      # what `shaped` can wrap
PROTOCOLS = ("tcp", "ipc")
DIST_BACKENDS = ("gloo", "nccl")
# zmq takes a timeout as a C int of milliseconds (setsockopt) or a long (poll), and so does Ray
# (placement, ray.get): a longer one overflows there
MAX_TIMEOUT_S = (2**31 - 1) / 1000     # ~24.8 days


def timeout_problem(value: float) -> str | None:
    """Why `value` cannot be a timeout in seconds that reaches zmq or Ray, or None."""
    if not value > 0:
        return f"must be > 0, got {value}"
    if value > MAX_TIMEOUT_S:
        return (f"must be at most {MAX_TIMEOUT_S:,.0f} s (~24 days: zmq and Ray take it as 32-bit milliseconds), "
                f"got {value:g}")
    return None


@dataclass
class TransferConfig:
    transport: str = "zmq"                # zmq | torch_dist | shaped
    layerwise: bool = False               # stream each layer as soon as it is computed
    protocol: str = "tcp"                 # zmq endpoints (data for zmq, control for torch_dist)
    host: str = "127.0.0.1"               # the address receivers bind and advertise
    # 1-4 MiB chunks move ~3x faster than one 64 MiB message on this loopback; 1 MiB (this
    # CPU's L2) measured a little faster than 2 MiB end to end (bench_transport.py)
    frame_bytes: int = 1 * MiB
    # SO_SNDBUF / SO_RCVBUF of the data connection (0: the kernel's autotuning), capped by
    # net.core.wmem_max / rmem_max
    socket_buffer_bytes: int = 0
    max_header_bytes: int = 64 * 1024     # a header (or ack) frame larger than this is rejected
    max_message_bytes: int = 1024 * MiB   # a payload declaring more bytes than this is rejected
    timeout_s: float = 30.0               # blocking sends, rendezvous, waits for data after its header
    # blocks held for a hand-off whose acknowledgement never comes are freed after this long
    # (vLLM's NIXL connector: 30 s): the prefill side's from sending the KV to `release`, the
    # decode side's from reserving to the KV's arrival, so it also bounds the prompt's wait
    # and prefill at its prefill worker (raise it for long queues); real runtime only
    lease_s: float = 30.0
    # KV bytes a sender may have in flight (sent, not yet acknowledged) to each receiver; more
    # waits, unpacked, in the sender's blocks, so a slow receiver costs the sender bounded memory
    # (a request larger than this still goes, alone); real runtime only
    max_inflight_mb: float = 64.0
    # shaped: a real transport behind an emulated link
    shaped_inner: str = "zmq"
    rate_gbps: float = 25.0               # gigabits per second
    latency_ms: float = 0.0               # one-way, added to every payload
    # torch_dist
    dist_backend: str = "gloo"            # gloo (CPU) | nccl (one GPU per rank)
    pin_memory: bool = False              # receive into pinned host buffers (GPU caches)
    # fault injection for tests: corrupt the n-th payload each sender sends (1-based); 0 never
    fault_corrupt_nth: int = 0

    @property
    def rate_bytes_per_s(self) -> float:
        return self.rate_gbps * 1e9 / 8

    def validate(self) -> None:
        def bad(field: str, why: str) -> ValueError:
            return ValueError(f"transfer.{field}: {why}")
        if self.transport not in TRANSPORTS:
            raise bad("transport", f"'{self.transport}' is not one of {', '.join(TRANSPORTS)}")
        if self.shaped_inner not in REAL_TRANSPORTS:
            raise bad("shaped_inner", f"'{self.shaped_inner}' is not one of {', '.join(REAL_TRANSPORTS)}")
        if self.protocol not in PROTOCOLS:
            raise bad("protocol", f"'{self.protocol}' is not one of {', '.join(PROTOCOLS)}")
        if not self.host:
            raise bad("host", f"must be an address to bind, e.g. {TransferConfig.host}")
        if self.max_header_bytes < 1024:
            raise bad("max_header_bytes", f"must be >= 1024, got {self.max_header_bytes}")
        if self.frame_bytes < 4096:
            raise bad("frame_bytes", f"must be >= 4096, got {self.frame_bytes} (1-4 MiB is fastest)")
        if self.socket_buffer_bytes < 0:
            raise bad("socket_buffer_bytes", f"must be >= 0 (0: the kernel's autotuning), got {self.socket_buffer_bytes}")
        if self.max_message_bytes < self.frame_bytes:
            raise bad("max_message_bytes", f"{self.max_message_bytes} must be >= frame_bytes={self.frame_bytes}")
        if problem := timeout_problem(self.timeout_s):
            raise bad("timeout_s", problem)
        if not self.lease_s > 0:
            raise bad("lease_s", f"must be > 0 seconds, got {self.lease_s}")
        if not self.max_inflight_mb > 0:
            raise bad("max_inflight_mb", f"must be > 0 MiB, got {self.max_inflight_mb}")
        if not self.rate_gbps > 0:
            raise bad("rate_gbps", f"must be > 0, got {self.rate_gbps}")
        if not self.latency_ms >= 0:
            raise bad("latency_ms", f"must be >= 0, got {self.latency_ms}")
        if self.dist_backend not in DIST_BACKENDS:
            raise bad("dist_backend", f"'{self.dist_backend}' is not one of {', '.join(DIST_BACKENDS)}")
        if self.fault_corrupt_nth < 0:
            raise bad("fault_corrupt_nth", f"must be >= 0 (0 disables), got {self.fault_corrupt_nth}")
