"""Triton copies between paged KV blocks and one contiguous buffer: the GPU
side of KV hand-off (README.md, "Architecture").

Data flow: a prefill worker gathers a request's blocks into one buffer (the
unit a transport sends), the decode worker scatters the received buffer into
the block ids it allocated. Same signatures as kernels/kv_ops.py's
`gather_blocks` / `scatter_blocks` (torch indexing, the CPU path), so callers
pick one module by device and nothing else changes.

The tensor is viewed as [outer, num_blocks, inner] around the block
dimension `dim` (e.g. the full cache [layers, 2, num_blocks, block_size,
heads, head_dim] with dim=2: outer = layers * 2), and copied as raw integers
of the element's width, so every dtype (bf16, fp8, ...) takes the same path.
"""
from __future__ import annotations

import torch

from testbed.kernels.triton_interpret import check_runnable, interpret_without_gpu

interpret_without_gpu()
import triton  # noqa: E402  (after interpret_without_gpu: Triton reads the switch at import)
import triton.language as tl  # noqa: E402

_INT_OF_WIDTH = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@triton.jit
def _copy_blocks_kernel(src_ptr, dst_ptr, block_ids_ptr, num_ids, src_outer_stride, dst_outer_stride, inner,
                        GATHER: tl.constexpr, BLOCK: tl.constexpr):
    """Program (o * num_ids + i, j) copies elements [j*BLOCK, (j+1)*BLOCK) of
    row (o, i). GATHER: src row block_ids[i] -> dst row i; else (scatter)
    src row i -> dst row block_ids[i]."""
    pid = tl.program_id(0)
    o = (pid // num_ids).to(tl.int64)
    i = pid % num_ids
    block = tl.load(block_ids_ptr + i)              # int64
    if GATHER:
        src_row = o * src_outer_stride + block * inner
        dst_row = o * dst_outer_stride + i.to(tl.int64) * inner
    else:
        src_row = o * src_outer_stride + i.to(tl.int64) * inner
        dst_row = o * dst_outer_stride + block * inner
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < inner
    tl.store(dst_ptr + dst_row + offs, tl.load(src_ptr + src_row + offs, mask=mask), mask=mask)


def _rows(t: torch.Tensor, dim: int, what: str) -> torch.Tensor:
    """t viewed as [outer, t.shape[dim], inner] integers, without copying."""
    outer, inner = t.shape[:dim].numel(), t.shape[dim + 1:].numel()
    try:
        rows = t.view(outer, t.shape[dim], inner)
    except RuntimeError as e:
        raise ValueError(f"{what} {tuple(t.shape)} with strides {t.stride()} cannot be viewed as "
                         f"[outer, blocks, inner] around dim {dim}; it needs to be contiguous") from e
    if rows.stride(2) != 1:
        raise ValueError(f"{what} needs contiguous dims after dim {dim}")
    return rows.view(_INT_OF_WIDTH[t.element_size()])


def _checked_ids(block_ids: torch.Tensor, num_blocks: int, device: torch.device) -> torch.Tensor:
    if block_ids.dim() != 1 or block_ids.dtype.is_floating_point:
        raise ValueError(f"block_ids must be a 1-D integer tensor, got {block_ids.dtype} {tuple(block_ids.shape)}")
    # Bounds are checked where that costs no device sync; ids already on the GPU are trusted.
    if block_ids.device.type == "cpu" and block_ids.numel() and not (0 <= int(block_ids.min()) and
                                                                     int(block_ids.max()) < num_blocks):
        raise ValueError(f"block_ids {block_ids.tolist()} out of range for {num_blocks} blocks")
    return block_ids.to(device=device, dtype=torch.int64)


def _launch(src_rows: torch.Tensor, dst_rows: torch.Tensor, ids: torch.Tensor, gather: bool) -> None:
    outer, _, inner = src_rows.shape
    n = ids.numel()
    if n == 0 or outer == 0 or inner == 0:
        return
    check_runnable(_copy_blocks_kernel, src_rows.device)
    # GPU: ~8 KiB per program keeps many in flight; interpreter: one program per row.
    block = triton.next_power_of_2(inner)
    if src_rows.device.type == "cuda":
        block = min(block, 8192 // src_rows.element_size())
    grid = (outer * n, triton.cdiv(inner, block))
    _copy_blocks_kernel[grid](src_rows, dst_rows, ids, n, src_rows.stride(0), dst_rows.stride(0), inner,
                              GATHER=gather, BLOCK=block, num_warps=4)


def gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, dim: int = 0,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """cache.index_select(dim, block_ids), into `out` when given."""
    dim = dim % cache.dim()
    shape = list(cache.shape)
    shape[dim] = block_ids.numel()
    if out is None:
        out = torch.empty(shape, dtype=cache.dtype, device=cache.device)
    elif list(out.shape) != shape or out.dtype != cache.dtype or out.device != cache.device:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device}: need {tuple(shape)} "
                         f"{cache.dtype} on {cache.device}")
    ids = _checked_ids(block_ids, cache.shape[dim], cache.device)
    _launch(_rows(cache, dim, "cache"), _rows(out, dim, "out"), ids, gather=True)
    return out


def scatter_blocks(cache: torch.Tensor, block_ids: torch.Tensor, data: torch.Tensor, dim: int = 0) -> None:
    """cache[..., block_ids, ...] = data along `dim`."""
    dim = dim % cache.dim()
    shape = list(cache.shape)
    shape[dim] = block_ids.numel()
    if list(data.shape) != shape or data.dtype != cache.dtype or data.device != cache.device:
        raise ValueError(f"data {tuple(data.shape)} {data.dtype} on {data.device}: need {tuple(shape)} "
                         f"{cache.dtype} on {cache.device}")
    ids = _checked_ids(block_ids, cache.shape[dim], cache.device)
    _launch(_rows(data, dim, "data"), _rows(cache, dim, "cache"), ids, gather=False)
