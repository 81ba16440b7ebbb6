"""The torch_dist transport: payload data over torch.distributed point-to-point
send/recv (gloo between CPU processes, NCCL between GPUs), its header over the
zmq channel, which also carries the acks.

Workers join one process group: the launcher starts a rendezvous store
(`start_rendezvous`), gives every worker its address, a rank and the world
size, and each worker builds one `TorchDistGroup` that its sender and receiver
share. The group is an object, not torch's global default group, so several
can coexist in tests and close() really tears it down.

Order: the sender sends the header on the channel, then posts the data send;
the receiver posts the matching recv when it reads the header. Point-to-point
messages between two ranks match in order, as do the headers on one channel.

NCCL cannot put two ranks on one GPU, so one GPU means the zmq transport with
host staging. With NCCL the data is staged host -> GPU on the sender and GPU
-> host on the receiver (payloads live in host memory); untested here (no GPU).
"""
from __future__ import annotations

import collections
import datetime
import time
from urllib.parse import urlparse

import msgpack
import torch
import torch.distributed as dist
import xxhash

from testbed.kv_transfer.base import TransferError
from testbed.kv_transfer.channel import HEADER, ChannelSender
from testbed.kv_transfer.receiver import ChannelReceiver
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.landing import Landing
from testbed.kv_transfer.payload import KVPayload

DATA_TAG = 0


def _host_port(address: str) -> tuple[str, int]:
    url = urlparse(address)
    if url.scheme != "tcp" or not url.hostname or not url.port:
        raise ValueError(f"init address '{address}' must look like tcp://HOST:PORT")
    return url.hostname, url.port


def start_rendezvous(host: str, timeout_s: float = 30.0) -> tuple[dist.TCPStore, str]:
    """The launcher's half: a TCPStore on a free port of `host`. Keep the store
    object alive while the workers run; give them the returned address."""
    store = dist.TCPStore(host, 0, None, True, timeout=datetime.timedelta(seconds=timeout_s),
                          wait_for_workers=False)
    return store, f"tcp://{host}:{store.port}"


class TorchDistGroup:
    """One worker's membership of the transfer process group."""

    def __init__(self, init_address: str, rank: int, world_size: int, backend: str = "gloo",
                 timeout_s: float = 30.0, bind_host: str | None = None) -> None:
        """`bind_host`: the address gloo listens on, this worker's own (the rendezvous's
        host when None; on another node that address is not this one's)."""
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is not within world_size {world_size}")
        host, port = _host_port(init_address)
        self.rank, self.world_size, self.backend = rank, world_size, backend
        timeout = datetime.timedelta(seconds=timeout_s)
        self._store = dist.TCPStore(host, port, None, False, timeout=timeout)
        if backend == "gloo":
            # an explicit device, so gloo listens on this address rather than on whatever the hostname resolves to
            opts = dist.ProcessGroupGloo._Options()
            opts._devices = [dist.ProcessGroupGloo.create_device(hostname=bind_host or host)]
            opts._timeout = timeout
            self.pg = dist.ProcessGroupGloo(self._store, rank, world_size, opts)
            self.device = torch.device("cpu")
        elif backend == "nccl":
            self.device = torch.device("cuda", torch.cuda.current_device())
            self.pg = dist.ProcessGroupNCCL(self._store, rank, world_size)
        else:
            raise ValueError(f"transfer.dist_backend: '{backend}' is not one of gloo, nccl")

    def close(self) -> None:
        if self.pg is not None:
            self.pg.shutdown()
            self.pg = None
            self._store = None


class TorchDistSender(ChannelSender):
    def __init__(self, cfg: TransferConfig, group: TorchDistGroup, name: str | None = None, curve=None) -> None:
        super().__init__(cfg, name, curve)
        self.group = group
        self._ranks: dict[str, int] = {}
        self._in_flight: collections.deque[tuple[dist.Work, torch.Tensor]] = collections.deque()

    def connect(self, peer: str, address: str) -> None:
        channel, _, rank = address.rpartition("#rank=")
        if not channel or not rank.isdigit() or not 0 <= int(rank) < self.group.world_size:
            raise ValueError(f"torch_dist address '{address}' must be a receiver's .address "
                             f"(<zmq endpoint>#rank=<rank below {self.group.world_size}>)")
        super().connect(peer, channel)
        self._ranks[peer] = int(rank)

    def send(self, peer: str, payload: KVPayload) -> None:
        if payload.parts is not None:
            raise ValueError(f"request {payload.request_id}: torch_dist sends one contiguous tensor; "
                             "pack_kv the payload (view_kv's parts are for senders with takes_parts)")
        sock = self._client.socket(peer)
        flat = payload.data.reshape(-1).view(torch.uint8)
        if flat.device != self.group.device:
            flat = flat.to(self.group.device)
        sock.send_multipart([HEADER, payload.encode_header(), msgpack.packb(self.group.rank)])
        # the work keeps `flat` alive until the receiver has taken it
        try:
            work = self.group.pg.send([flat], self._ranks[peer], DATA_TAG)
        except RuntimeError as e:      # gloo: the peer's rank is gone
            raise TransferError(f"sender {self.name}: send to {peer} (rank {self._ranks[peer]}) failed: {e}") from None
        self._in_flight.append((work, flat))
        while self._in_flight and self._in_flight[0][0].is_completed():
            self._in_flight.popleft()

    def flush(self, timeout_s: float | None = None) -> None:
        deadline = time.monotonic() + (self.cfg.timeout_s if timeout_s is None else timeout_s)
        while self._in_flight:
            work, _ = self._in_flight[0]
            try:
                work.wait(datetime.timedelta(seconds=max(0.001, deadline - time.monotonic())))
            except RuntimeError as e:
                raise TransferError(f"sender {self.name}: data send failed or timed out: {e}") from None
            self._in_flight.popleft()

    def close(self) -> None:
        self._in_flight.clear()
        super().close()


class TorchDistReceiver(ChannelReceiver):
    def __init__(self, cfg: TransferConfig, group: TorchDistGroup, max_payloads_per_poll: int = 64,
                 curve=None) -> None:
        super().__init__(cfg, max_payloads_per_poll, curve)
        self.group = group
        self.address = f"{self._server.address}#rank={group.rank}"

    def _on_header(self, origin: str, payload: KVPayload, landing: Landing | None) -> list[KVPayload]:
        try:
            src_rank = msgpack.unpackb(self._server.sock.recv()) if self._server.more() else None
        except Exception:
            src_rank = None
        # the process group delivers the data whole: into the landing when it is one buffer, else via a pooled one
        view = landing.view(0) if landing is not None else None
        buf = torch.frombuffer(view, dtype=torch.uint8) if view is not None else self._buffers.take(payload.nbytes)
        if not isinstance(src_rank, int) or not 0 <= src_rank < self.group.world_size or src_rank == self.group.rank:
            self._release_staging(buf, view)
            if landing is None:
                return []
            return [self._drop(payload, landing, f"header without a valid sender rank ({src_rank!r})")]
        landing_buf = buf if self.group.device.type == "cpu" else torch.empty_like(buf, device=self.group.device)
        try:
            self.group.pg.recv([landing_buf], src_rank, DATA_TAG).wait(
                datetime.timedelta(seconds=self.cfg.timeout_s))
        except RuntimeError as e:
            self._release_staging(buf, view)
            if landing is None:
                return []
            return [self._drop(payload, landing, f"data from rank {src_rank} did not arrive: {e}")]
        if landing_buf is not buf:
            buf.copy_(landing_buf)
        if landing is None:                      # refused: the data had to be taken off the group anyway
            self._release_staging(buf, view)
            return []
        digest = xxhash.xxh3_64_intdigest(buf.numpy())
        if view is None:                          # verified before a byte reaches the destination
            if digest == payload.checksum:
                landing.write(0, memoryview(buf.numpy()))
            self._buffers.release(buf)
        return [self._land(payload, landing, digest)]

    def _release_staging(self, buf: torch.Tensor, view) -> None:
        if view is None:
            self._buffers.release(buf)
