"""pack_kv / unpack_kv: between a worker's paged KV cache and a KVPayload.

The sender gathers a request's blocks for a layer range into one contiguous
buffer (the only copy on the sending side: the transports send that buffer's
memory zero-copy); the receiver writes the buffer into the blocks it reserved.
Block ids are coalesced into runs of adjacent ids: a few runs are copied as
slices, many short runs as one index_select/index_copy (per-run copies cost
~5 us each, so 256 single blocks would be 5x slower than one gather).
GPU caches are gathered on the device and staged through host memory (pinned
when `out` is a pinned buffer), because the payload's data is always on the CPU.

`view_kv` is pack_kv without the gather, for senders that take `parts`
(zmq, torch_dist): the payload's bytes are the cache's own contiguous
segments, one per (layer, k/v, run of adjacent source blocks), sent zero-copy,
and its checksum is left to the sender (`checksum=None`): zmq hashes each
chunk as it goes and sends the digest after the data, so nothing precedes
the first byte on the wire (what a checksum or a gather first costs:
bench_two_node_phases.py, experiments/README.md "Two nodes"). The blocks must not change until the receiver
has acknowledged the payload: the prefill worker holds them until `Release`
(a lease that expires first frees them, and the receiver's checksum then
fails a payload whose blocks were rewritten meanwhile).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from testbed.kernels.kv_ops import gather_blocks, scatter_blocks
from testbed.kv_transfer.payload import DTYPE_NAMES, DTYPES, KVPayload, PayloadError, checksum

MAX_SLICED_RUNS = 8


def coalesce_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[(first_id, length)] for maximal runs of consecutive ids, in order:
    [4, 5, 6, 9, 2, 3] -> [(4, 3), (9, 1), (2, 2)]."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def _check_cache(cache: torch.Tensor) -> None:
    if cache.dim() != 6 or cache.shape[1] != 2:
        raise ValueError(f"cache shape {tuple(cache.shape)} is not [num_layers, 2, num_blocks, block_size, "
                         "num_kv_heads, head_dim]")
    if cache.dtype not in DTYPE_NAMES:
        raise ValueError(f"cache dtype {cache.dtype} cannot be sent; use one of {sorted(DTYPES)}")


def _check_ids(what: str, ids: Sequence[int], num_blocks: int) -> None:
    bad = [b for b in ids if not 0 <= b < num_blocks]
    if bad:
        raise PayloadError(f"{what} {bad[:4]} out of range for a cache of {num_blocks} blocks")
    if len(set(ids)) != len(ids):
        raise PayloadError(f"{what} has duplicates: {list(ids)[:16]}")


def _check_request(cache: torch.Tensor, layers: tuple[int, int], src_block_ids: Sequence[int],
                   dst_block_ids: Sequence[int], num_tokens: int, request_id: str) -> tuple[int, ...]:
    """The payload's shape, once the arguments are checked against the cache."""
    _check_cache(cache)
    layer_start, layer_end = layers
    num_layers, _, num_blocks, block_size = cache.shape[:4]
    if not 0 <= layer_start < layer_end <= num_layers:
        raise ValueError(f"layers={layers} is not a non-empty range within [0, {num_layers})")
    if not src_block_ids or len(src_block_ids) != len(dst_block_ids):
        raise ValueError(f"request {request_id}: {len(src_block_ids)} source and {len(dst_block_ids)} "
                         "destination block ids; they must be non-empty and the same length")
    _check_ids("src_block_ids", src_block_ids, num_blocks)
    if not 0 < num_tokens <= len(src_block_ids) * block_size:
        raise ValueError(f"request {request_id}: num_tokens={num_tokens} does not fit "
                         f"{len(src_block_ids)} blocks of {block_size}")
    return (layer_end - layer_start, 2, len(src_block_ids), *cache.shape[3:])


def view_kv(cache: torch.Tensor, layers: tuple[int, int], src_block_ids: Sequence[int],
            dst_block_ids: Sequence[int], num_tokens: int, request_id: str, *, last: bool = True,
            meta: dict | None = None) -> KVPayload | None:
    """pack_kv's payload with `parts` (views of `cache`) instead of packed data; None
    where a gather is better: a GPU or non-contiguous cache, or more than
    MAX_SLICED_RUNS runs of adjacent source blocks (many small segments)."""
    shape = _check_request(cache, layers, src_block_ids, dst_block_ids, num_tokens, request_id)
    runs = coalesce_runs(src_block_ids)
    if cache.is_cuda or not cache.is_contiguous() or len(runs) > MAX_SLICED_RUNS:
        return None
    parts = [cache[layer, kv, first:first + n] for layer in range(*layers) for kv in (0, 1) for first, n in runs]
    return KVPayload(request_id=request_id, layer_start=layers[0], layer_end=layers[1],
                     block_ids=list(dst_block_ids), num_tokens=num_tokens, dtype=DTYPE_NAMES[cache.dtype],
                     shape=shape, checksum=None, data=torch.empty(0, dtype=cache.dtype), last=last,
                     meta=dict(meta or {}), parts=parts)


def pack_kv(cache: torch.Tensor, layers: tuple[int, int], src_block_ids: Sequence[int],
            dst_block_ids: Sequence[int], num_tokens: int, request_id: str, *, last: bool = True,
            meta: dict | None = None, out: torch.Tensor | None = None) -> KVPayload:
    """Gather `cache[layers[0]:layers[1], :, src_block_ids]` into a payload for
    the receiver's `dst_block_ids`. `out`: an optional flat uint8 CPU buffer
    (reused, or pinned for GPU caches) the data is written into; do not reuse
    it before the sender's flush()."""
    shape = _check_request(cache, layers, src_block_ids, dst_block_ids, num_tokens, request_id)
    layer_start, layer_end = layers
    if out is None:
        data = torch.empty(shape, dtype=cache.dtype, pin_memory=cache.is_cuda)
    else:
        nbytes = torch.Size(shape).numel() * cache.element_size()
        if out.dtype != torch.uint8 or out.device.type != "cpu" or not out.is_contiguous() or out.numel() < nbytes:
            raise ValueError(f"out must be a contiguous CPU uint8 buffer of >= {nbytes} bytes, got "
                             f"{out.dtype} {tuple(out.shape)} on {out.device}")
        data = out.reshape(-1)[:nbytes].view(cache.dtype).view(shape)
    src = cache[layer_start:layer_end]
    if cache.is_cuda:
        staged = torch.empty(shape, dtype=cache.dtype, device=cache.device)
        _gather(src, src_block_ids, staged)
        data.copy_(staged)
    else:
        _gather(src, src_block_ids, data)
    return KVPayload(request_id=request_id, layer_start=layer_start, layer_end=layer_end,
                     block_ids=list(dst_block_ids), num_tokens=num_tokens, dtype=DTYPE_NAMES[cache.dtype],
                     shape=shape, checksum=checksum(data), data=data, last=last, meta=dict(meta or {}))


def check_fits(cache: torch.Tensor, payload: KVPayload) -> None:
    """Raise PayloadError unless everything payload's header claims fits this
    cache: the header came off the network."""
    _check_cache(cache)
    rid = payload.request_id
    if payload.error is not None:
        raise PayloadError(f"request {rid}: refusing to unpack a failed payload ({payload.error})", rid)
    if payload.dtype != DTYPE_NAMES[cache.dtype]:
        raise PayloadError(f"request {rid}: payload dtype {payload.dtype} != cache dtype {cache.dtype}", rid)
    if tuple(payload.shape[3:]) != tuple(cache.shape[3:]):
        raise PayloadError(f"request {rid}: payload blocks {tuple(payload.shape[3:])} != cache blocks "
                           f"{tuple(cache.shape[3:])} (block_size, kv heads, head dim)", rid)
    if not 0 <= payload.layer_start < payload.layer_end <= cache.shape[0]:
        raise PayloadError(f"request {rid}: layers [{payload.layer_start}, {payload.layer_end}) outside "
                           f"the cache's {cache.shape[0]}", rid)
    if len(payload.block_ids) != payload.shape[2]:
        raise PayloadError(f"request {rid}: {len(payload.block_ids)} block ids do not match header shape "
                           f"{tuple(payload.shape)}", rid)
    _check_ids(f"request {rid}: block_ids", payload.block_ids, cache.shape[2])


def unpack_kv(cache: torch.Tensor, payload: KVPayload) -> None:
    """Write a received (verified) payload into `cache` at payload.block_ids."""
    check_fits(cache, payload)
    rid = payload.request_id
    if tuple(payload.data.shape) != tuple(payload.shape):
        raise PayloadError(f"request {rid}: data {tuple(payload.data.shape)} does not match header shape "
                           f"{tuple(payload.shape)}", rid)
    data = payload.data.to(cache.device)
    dst = cache[payload.layer_start:payload.layer_end]
    runs = coalesce_runs(payload.block_ids)
    if len(runs) <= MAX_SLICED_RUNS:
        pos = 0
        for first, n in runs:
            dst[:, :, first:first + n].copy_(data[:, :, pos:pos + n])
            pos += n
    else:
        scatter_blocks(dst, torch.tensor(payload.block_ids, device=cache.device), data, dim=2)


def _gather(src: torch.Tensor, block_ids: Sequence[int], into: torch.Tensor) -> None:
    """into[:, :, i] = src[:, :, block_ids[i]]"""
    runs = coalesce_runs(block_ids)
    if len(runs) <= MAX_SLICED_RUNS:
        pos = 0
        for first, n in runs:
            into[:, :, pos:pos + n].copy_(src[:, :, first:first + n])
            pos += n
    else:
        gather_blocks(src, torch.tensor(list(block_ids), device=src.device), dim=2, out=into)
