"""Landings: where a receiver puts a payload's bytes while its chunks arrive.

- `BufferLanding`: one pooled contiguous buffer, which becomes payload.data
  (for callers that unpack_kv later, or keep the bytes).
- `BlockLanding`: straight into the destination blocks of a paged KV cache.
  The payload's bytes, `[layers, 2, blocks, block_size, heads, head_dim]`,
  map onto one contiguous segment of the cache per (layer, k/v, run of
  adjacent block ids), so each chunk is copied once, from zmq's frame to where
  it belongs, while the next chunk is on the wire: no landing buffer, and no
  scatter after the last byte (bench_transport.py, "zmq ... into cache").

Bytes land in the reserved blocks before the checksum is verified; that is
safe because the blocks belong to the reservation alone (decode workers do
not share blocks) and the request is admitted only once the checksum passed.
A payload that fails leaves garbage in blocks that are then freed unread:
every slot is written before attention reads it. `valid()` lets the owner
withdraw a landing whose reservation was dropped while bytes were coming; the
receiver then discards the rest of that payload.
"""
from __future__ import annotations

import bisect
from collections.abc import Callable

import numpy as np
import torch

from testbed.kv_transfer.buffers import ReceiveBuffers
from testbed.kv_transfer.pack import check_fits, coalesce_runs
from testbed.kv_transfer.payload import DTYPES, KVPayload, flat_bytes


class Landing:
    """A destination for one payload's nbytes, written in order."""
    nbytes: int

    def view(self, offset: int) -> memoryview | None:
        """A writable view of the destination from `offset` to the end of the
        payload, when that is contiguous (the receiver recv_into's it); None
        when chunks must go through write()."""
        return None

    def write(self, offset: int, chunk: memoryview) -> None:
        """Put `chunk`, the payload's bytes [offset, offset + len(chunk)), in place."""
        raise NotImplementedError

    def valid(self) -> bool:
        """False once the destination has been withdrawn (the reservation dropped)."""
        return True

    def finish(self, p: KVPayload) -> None:
        """p's checksum passed: make its data usable."""

    def release(self) -> None:
        """The payload failed or was discarded: give back what was lent."""


class BufferLanding(Landing):
    def __init__(self, pool: ReceiveBuffers, nbytes: int) -> None:
        self.pool = pool
        self.nbytes = nbytes
        self.buf = pool.take(nbytes)          # flat uint8, nbytes long
        self._view = memoryview(self.buf.numpy())

    def view(self, offset: int) -> memoryview:
        return self._view[offset:]

    def write(self, offset: int, chunk: memoryview) -> None:
        self._view[offset:offset + len(chunk)] = chunk

    def finish(self, p: KVPayload) -> None:
        p.data = self.buf.view(DTYPES[p.dtype]).view(p.shape)

    def release(self) -> None:
        if self.buf is not None:
            self.pool.release(self.buf)
            self.buf = None


class BlockLanding(Landing):
    """The payload's bytes into cache[layer_start:layer_end, :, block_ids].
    Checks the header against the cache first (PayloadError)."""

    def __init__(self, cache: torch.Tensor, p: KVPayload, valid: Callable[[], bool] = lambda: True) -> None:
        check_fits(cache, p)
        if not cache.is_contiguous():
            raise ValueError("BlockLanding needs a contiguous cache")
        self.nbytes = p.nbytes
        self._valid = valid
        num_layers, _, num_blocks = p.shape[:3]
        block_bytes = p.nbytes // (num_layers * 2 * num_blocks)     # one block of one layer's k or v
        cache_bytes = flat_bytes(cache) if cache.device.type == "cpu" else cache.reshape(-1).view(torch.uint8)
        self._dst = cache_bytes.numpy() if cache.device.type == "cpu" else cache_bytes
        # segments in payload order: (payload offset, cache offset, length), one per (layer, k/v, run)
        self._src_starts: list[int] = []
        self._segments: list[tuple[int, int, int]] = []
        runs = coalesce_runs(p.block_ids)
        for row in range(num_layers * 2):                   # row = layer * 2 + (0: k, 1: v)
            layer, kv = divmod(row, 2)
            cache_row = ((p.layer_start + layer) * 2 + kv) * cache.shape[2]
            pos = 0
            for first, n in runs:
                src = (row * num_blocks + pos) * block_bytes
                self._src_starts.append(src)
                self._segments.append((src, (cache_row + first) * block_bytes, n * block_bytes))
                pos += n

    def view(self, offset: int) -> memoryview | None:
        return None

    def write(self, offset: int, chunk: memoryview) -> None:
        src = np.frombuffer(chunk, dtype=np.uint8) if isinstance(self._dst, np.ndarray) \
            else torch.frombuffer(chunk, dtype=torch.uint8)
        pos, end = offset, offset + len(chunk)
        i = bisect.bisect_right(self._src_starts, pos) - 1
        while pos < end:
            seg_src, seg_dst, seg_len = self._segments[i]
            n = min(end, seg_src + seg_len) - pos
            self._write(seg_dst + pos - seg_src, src[pos - offset:pos - offset + n])
            pos += n
            i += 1

    def _write(self, at: int, src) -> None:
        if isinstance(self._dst, np.ndarray):
            self._dst[at:at + len(src)] = src
        else:                                                # a GPU cache: copied from host memory
            self._dst[at:at + len(src)].copy_(src)

    def valid(self) -> bool:
        return self._valid()

    def finish(self, p: KVPayload) -> None:
        p.data = torch.empty(0, dtype=torch.uint8)
        p.in_place = True
