"""The torch_dist transport: payload data over torch.distributed point-to-point
send/recv (gloo between CPU processes, NCCL between GPUs), its header over the
zmq channel, which also carries the acks.

Workers join one process group: the launcher starts a rendezvous store
(`start_rendezvous`), gives every worker its address, a rank and the world
size, and each worker builds one `TorchDistGroup` that its sender and receiver
share. The group is an object, not torch's global default group, so several
can coexist in tests and close() really tears it down.

Order: the sender sends the header on the channel, with its rank and the
sizes of the data's pieces (each at most frame_bytes, a part of pack.view_kv
never split across two: a piece is a zero-copy view of the cache or of the
packed data), then posts one send per piece; the receiver posts the matching
recvs when it reads the header, RECV_DEPTH at a time, and hashes and lands each
piece while the next is on the wire. Point-to-point messages between two
ranks match in order, as do the headers on one channel.

NCCL cannot put two ranks on one GPU, so one GPU means the zmq transport with
host staging. With NCCL the data is staged host -> GPU on the sender and GPU
-> host on the receiver (payloads live in host memory); untested here (no GPU).
"""
from __future__ import annotations

import collections
import datetime
import itertools
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
MAX_PIECES = 1 << 16          # pieces one header may announce (1 MiB pieces: 64 GiB)
# recvs posted ahead: gloo sends a piece only once its recv is posted, so with two a receiver
# descheduled for one piece's time on the wire (1.7 ms at 5 Gb/s) stalled the link
RECV_DEPTH = 4


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
    takes_parts = True

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
        sock = self._client.socket(peer)
        step = self.cfg.frame_bytes
        pieces = [torch.from_numpy(part[off:off + step]) for part in payload.byte_parts()
                  for off in range(0, len(part), step)]
        if sum(len(p) for p in pieces) != payload.nbytes or not 0 < len(pieces) <= MAX_PIECES:
            raise ValueError(f"request {payload.request_id}: payload has {sum(len(p) for p in pieces)} bytes of "
                             f"data in {len(pieces)} pieces, its header declares {payload.nbytes}")
        payload = payload.with_checksum()      # (view_kv's have none): gloo's pieces are not hashed in flight
        sock.send_multipart([HEADER, payload.encode_header(),
                             msgpack.packb([self.group.rank, [len(p) for p in pieces]])])
        for piece in pieces:
            if piece.device != self.group.device:
                piece = piece.to(self.group.device)
            # the work keeps `piece` (a view of the caller's memory) alive until the receiver has taken it
            try:
                work = self.group.pg.send([piece], self._ranks[peer], DATA_TAG)
            except RuntimeError as e:      # gloo: the peer's rank is gone
                raise TransferError(f"sender {self.name}: send to {peer} (rank {self._ranks[peer]}) "
                                    f"failed: {e}") from None
            self._in_flight.append((work, piece))
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
            src_rank, sizes = msgpack.unpackb(self._server.sock.recv()) if self._server.more() else (None, None)
        except Exception:
            src_rank, sizes = None, None
        bad = _bad_extras(src_rank, sizes, payload.nbytes, self.group)
        if bad is not None:            # nothing can be taken off the group: it is not known what comes
            return [] if landing is None else [self._drop(payload, landing, bad)]
        # each piece into the landing when it is one buffer, else into one of RECV_DEPTH pooled ones,
        # from which it is written to the landing (and hashed) while the next pieces are on the wire
        view = landing.view(0) if landing is not None else None
        offsets = [0, *itertools.accumulate(sizes)]
        depth = min(RECV_DEPTH, len(sizes))
        slots = [] if view is not None else [self._buffers.take(max(sizes)) for _ in range(depth)]
        hasher = xxhash.xxh3_64()
        posted: collections.deque = collections.deque()

        def post(i: int) -> None:
            host = torch.frombuffer(view[offsets[i]:offsets[i] + sizes[i]], dtype=torch.uint8) \
                if view is not None else slots[i % depth][:sizes[i]]
            on_group = host if self.group.device.type == "cpu" else torch.empty_like(host, device=self.group.device)
            posted.append((host, on_group, self.group.pg.recv([on_group], src_rank, DATA_TAG)))

        try:
            for i in range(depth):
                post(i)
            for i in range(len(sizes)):
                host, on_group, work = posted.popleft()
                work.wait(datetime.timedelta(seconds=self.cfg.timeout_s))
                if on_group is not host:
                    host.copy_(on_group)
                if landing is not None:
                    chunk = memoryview(host.numpy())
                    hasher.update(chunk)
                    if view is None:
                        landing.write(offsets[i], chunk)
                if i + depth < len(sizes):
                    post(i + depth)
        except RuntimeError as e:
            # pieces still posted may yet be written: their pooled buffers are not reused
            if landing is None:
                return []
            return [self._drop(payload, landing, f"data from rank {src_rank} did not arrive: {e}")]
        for buf in slots:
            self._buffers.release(buf)
        if landing is None:                      # refused: the data had to be taken off the group anyway
            return []
        return [self._land(payload, landing, hasher.intdigest())]


def _bad_extras(src_rank, sizes, nbytes: int, group: TorchDistGroup) -> str | None:
    """Why a header's [rank, piece sizes] cannot be received from (None: it can)."""
    if not isinstance(src_rank, int) or not 0 <= src_rank < group.world_size or src_rank == group.rank:
        return f"header without a valid sender rank ({src_rank!r})"
    if (not isinstance(sizes, list) or not 0 < len(sizes) <= MAX_PIECES
            or not all(isinstance(n, int) and n > 0 for n in sizes) or sum(sizes) != nbytes):
        return f"header without valid piece sizes for its {nbytes} bytes"
    return None
