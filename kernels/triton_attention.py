"""Paged attention for a whole mixed batch (decodes and prefill chunks) in one
Triton launch: the kernel behind `attention_backend=triton`.

Data flow: the engine writes this step's K/V into the paged cache, builds one
`AttentionMetadata` per step, and every layer calls the backend; the backend
turns the metadata into an `AttentionPlan` once per step (`plan_attention`,
host side) and launches `paged_attention` once per layer.

How the work is cut. One program computes one *query tile* of one sequence for
one KV head: up to BLOCK_M // GROUP consecutive queries of that sequence times
the GROUP query heads that share the KV head, stacked as the BLOCK_M rows of a
single matrix. Each KV tile is therefore loaded once per KV head, not once per
query head (GQA), and a decode (one query) still fills GROUP rows of the dot.
The host lists the (sequence, query tile) pairs, longest context first, so
that the long programs start early and the short ones fill the tail.

Causality is bottom-right aligned: query i of a q_len-query slice in a seq_len
context sits at position seq_len - q_len + i and sees keys 0 .. that position.
KV tiles every row of a program sees whole skip the mask; only the last few
tiles (the chunk's own diagonal, a decode's last tile) pay for it.

When the query tiles alone would leave most SMs idle (a few long decodes),
each tile's keys are also split NUM_SPLITS ways (flash-decoding): the programs
write normalised partial outputs and their log-sum-exp, and a small second
kernel merges them. One kernel source either way; NUM_SPLITS is a constexpr.

On a machine without a GPU the same kernel runs through Triton's interpreter
(kernels/triton_interpret.py), for the tests and the CPU engine.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from testbed.kernels.attention import AttentionMetadata, DecodeMetadata
from testbed.kernels.triton_interpret import check_runnable, interpret_without_gpu

interpret_without_gpu()
import triton  # noqa: E402  (after interpret_without_gpu: Triton reads the switch at import)
import triton.language as tl  # noqa: E402

LOG2E = 1.4426950408889634


@triton.jit
def _attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table, kv_head_off,
                  lo, hi, kv_end, scale_log2e, stride_cb, stride_ct, d, d_valid,
                  BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr,
                  DOT_FP32: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Online softmax over key tiles [lo, hi). MASKED: the tiles where some
    row's causal limit or the context's end falls; unmasked tiles are seen
    whole by every row and skip all per-key tests."""
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)                 # [BLOCK_N] key positions
        if MASKED:
            n_valid = n < kv_end
            block = tl.load(block_table + n // BLOCK_SIZE, mask=n_valid, other=0).to(tl.int64)
        else:
            block = tl.load(block_table + n // BLOCK_SIZE).to(tl.int64)
        kv_offs = block * stride_cb + (n % BLOCK_SIZE) * stride_ct + kv_head_off        # [BLOCK_N]
        if MASKED:
            k = tl.load(k_cache_ptr + kv_offs[None, :] + d[:, None],
                        mask=n_valid[None, :] & d_valid[:, None], other=0.0)           # [BLOCK_D, BLOCK_N]
        else:
            k = tl.load(k_cache_ptr + kv_offs[None, :] + d[:, None], mask=d_valid[:, None], other=0.0)
        if DOT_FP32:
            k = k.to(tl.float32)
        s = tl.dot(q, k, input_precision=DOT_PRECISION) * scale_log2e                # [BLOCK_M, BLOCK_N]
        if MASKED:
            s = tl.where((n[None, :] <= q_pos[:, None]) & n_valid[None, :], s, float("-inf"))
        # Base-2 online softmax. Every row sees every key of an unmasked tile, so
        # only masked tiles can leave a row with nothing yet (a key split that
        # starts past its causal limit): shift by 0 there, not -inf, so that such
        # a row keeps l = 0 and acc = 0 instead of NaN.
        m_new = tl.maximum(m_i, tl.max(s, 1))
        if MASKED:
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        if MASKED:
            v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :],
                        mask=n_valid[:, None] & d_valid[None, :], other=0.0)           # [BLOCK_N, BLOCK_D]
        else:
            v = tl.load(v_cache_ptr + kv_offs[:, None] + d[None, :], mask=d_valid[None, :], other=0.0)
        if DOT_FP32:
            v = v.to(tl.float32)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        m_i = m_new
    return acc, l_i, m_i


@triton.jit
def _paged_attention_kernel(
    out_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    block_tables_ptr, seq_lens_ptr, query_start_loc_ptr, work_seq_ptr, work_q_first_ptr,
    part_ptr, lse_ptr,                          # NUM_SPLITS > 1: fp32 [splits, T, Hq, D] and [splits, T, Hq]
    scale_log2e, num_kv_heads, num_heads, num_tokens,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cb, stride_ct, stride_ch,            # cache strides: block, token in block, head (dim is 1)
    stride_bt,                                  # block table row stride
    BLOCK_SIZE: tl.constexpr,                   # tokens per KV cache block
    GROUP: tl.constexpr,                        # query heads per KV head
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,                      # HEAD_DIM rounded up to a power of two
    BLOCK_M: tl.constexpr,                      # rows per program: BLOCK_Q queries x GROUP (+ padding)
    BLOCK_Q: tl.constexpr,                      # BLOCK_M // GROUP
    BLOCK_N: tl.constexpr,                      # keys per inner-loop tile
    DOT_FP32: tl.constexpr,                     # upcast dot operands (interpreter has no bf16 matmul)
    DOT_PRECISION: tl.constexpr,                # "ieee" for fp32 inputs, else "tf32" (ignored for 16-bit)
    NUM_SPLITS: tl.constexpr,                   # key-range splits per program's work (1: no split)
):
    pid = tl.program_id(0)
    split = pid % NUM_SPLITS
    item = pid // NUM_SPLITS // num_kv_heads
    kv_head = pid // NUM_SPLITS % num_kv_heads
    seq = tl.load(work_seq_ptr + item)
    q_first = tl.load(work_q_first_ptr + item)          # first query of this tile, within the sequence
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - q_len

    rows = tl.arange(0, BLOCK_M)
    tok = q_first + rows // GROUP                         # [BLOCK_M] query index within the sequence
    head = kv_head * GROUP + rows % GROUP                 # [BLOCK_M] query head
    row_valid = (rows < BLOCK_Q * GROUP) & (tok < q_len)
    q_pos = context_len + tok                             # absolute position each row attends from
    d = tl.arange(0, BLOCK_D)
    d_valid = d < HEAD_DIM

    q_offs = (q_start + tok).to(tl.int64)[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_valid[:, None] & d_valid[None, :], other=0.0)   # [BLOCK_M, BLOCK_D]
    if DOT_FP32:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], tl.float32)

    # Keys [0, kv_end) are seen by some row; keys below full_end by every row.
    kv_end = context_len + tl.minimum(q_first + BLOCK_Q, q_len)
    full_end = (context_len + q_first + 1) // BLOCK_N * BLOCK_N
    unmasked_lo, unmasked_hi, masked_lo, masked_hi = 0, full_end, full_end, kv_end
    if NUM_SPLITS > 1:           # this program's share of the keys, in whole tiles
        split_len = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
        lo = split * split_len
        hi = tl.minimum(lo + split_len, kv_end)
        unmasked_lo, unmasked_hi = lo, tl.minimum(full_end, hi)
        masked_lo, masked_hi = tl.maximum(full_end, lo), hi
    block_table = block_tables_ptr + seq.to(tl.int64) * stride_bt
    kv_head_off = kv_head * stride_ch
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table, kv_head_off,
                                  unmasked_lo, unmasked_hi, kv_end, scale_log2e, stride_cb, stride_ct,
                                  d, d_valid, BLOCK_SIZE, BLOCK_N, False, DOT_FP32, DOT_PRECISION)
    acc, l_i, m_i = _attend_tiles(acc, l_i, m_i, q, q_pos, k_cache_ptr, v_cache_ptr, block_table, kv_head_off,
                                  masked_lo, masked_hi, kv_end, scale_log2e, stride_cb, stride_ct,
                                  d, d_valid, BLOCK_SIZE, BLOCK_N, True, DOT_FP32, DOT_PRECISION)

    store_mask = row_valid[:, None] & d_valid[None, :]
    if NUM_SPLITS > 1:
        # normalised partial output and its log2-sum-exp2; rows with no keys here weigh 0
        seen = l_i > 0
        row = (split * num_tokens + q_start + tok).to(tl.int64) * num_heads + head     # [BLOCK_M]
        part = tl.where(seen[:, None], acc / tl.where(seen, l_i, 1.0)[:, None], 0.0)
        tl.store(part_ptr + row[:, None] * HEAD_DIM + d[None, :], part, mask=store_mask)
        tl.store(lse_ptr + row, tl.where(seen, m_i + tl.log2(tl.where(seen, l_i, 1.0)), float("-inf")),
                 mask=row_valid)
    else:
        acc = acc / l_i[:, None]
        o_offs = (q_start + tok).to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
        tl.store(out_ptr + o_offs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _combine_splits_kernel(out_ptr, part_ptr, lse_ptr, num_rows, num_heads, stride_ot, stride_oh,
                           NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                           BLOCK_R: tl.constexpr):
    """Merge the key splits of BLOCK_R (token, head) rows: the same online
    softmax step as the main loop, with whole splits as the tiles."""
    r = tl.program_id(0) * BLOCK_R + tl.arange(0, BLOCK_R)
    r_valid = r < num_rows
    d = tl.arange(0, BLOCK_D)
    mask = r_valid[:, None] & (d < HEAD_DIM)[None, :]
    m = tl.full([BLOCK_R], float("-inf"), tl.float32)
    l = tl.zeros([BLOCK_R], tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], tl.float32)
    for s in range(NUM_SPLITS):
        row = s * num_rows + r.to(tl.int64)
        lse = tl.load(lse_ptr + row, mask=r_valid, other=float("-inf"))
        part = tl.load(part_ptr + row[:, None] * HEAD_DIM + d[None, :], mask=mask, other=0.0)
        m_new = tl.maximum(m, lse)
        m_new = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)
        acc = acc * alpha[:, None] + w[:, None] * part
        l = l * alpha + w
        m = m_new
    token, head = r // num_heads, r % num_heads
    o_offs = token.to(tl.int64)[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :]
    l = tl.where(r_valid, l, 1.0)            # every real row saw key 0 in split 0: l > 0
    tl.store(out_ptr + o_offs, (acc / l[:, None]).to(out_ptr.dtype.element_ty), mask=mask)


@dataclass(frozen=True)
class TileConfig:
    """Launch shape. block_m rows = (block_m // group) queries x group heads."""
    block_m: int
    block_n: int
    num_warps: int = 4
    num_stages: int = 2
    num_splits: int = 0          # key-range splits per query tile; 0: chosen by the plan from the GPU's size

    def __post_init__(self) -> None:
        for name in ("block_m", "block_n"):
            v = getattr(self, name)
            if v < 16 or v & (v - 1):
                raise ValueError(f"TileConfig.{name}={v}: must be a power of two >= 16 (tl.dot's minimum)")
        if self.num_splits < 0:
            raise ValueError(f"TileConfig.num_splits={self.num_splits}: must be >= 0 (0 chooses)")


def default_tile(max_query_len: int, group: int, device: torch.device) -> TileConfig:
    """Decode-only batches get the fewest rows that hold one query's group
    (memory-bound: rows are free, wasted ones are not); batches with chunks
    get 128 rows (compute-bound). The interpreter costs per program and per
    loop iteration, not per element, so on the CPU the tiles are as big as the
    work allows."""
    if device.type != "cuda":
        rows = triton.next_power_of_2(max(16, group * max_query_len))
        return TileConfig(block_m=min(rows, 256), block_n=256)
    # from the H200 tile sweep (experiments/gpu_check.sh, tile_sweep.csv): decode 64x4K reached 96% of the
    # copy bandwidth with 2 stages (69% with 3). 128x128 chunk tiles won on a 512-chunk over 32K but made
    # 512-chunk prefills of 4K-16K prompts slower and overflow shared memory for fp32 at head dim 128.
    if max_query_len == 1:
        return TileConfig(block_m=max(16, triton.next_power_of_2(group)), block_n=64, num_warps=4, num_stages=2)
    return TileConfig(block_m=max(128, triton.next_power_of_2(group)), block_n=64, num_warps=8, num_stages=3)


@dataclass
class AttentionPlan:
    """Device-side copy of one step's metadata plus the program work list;
    built once per step, reused by every layer."""
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32
    block_tables: torch.Tensor      # [B, max_blocks] int32
    work_seq: torch.Tensor          # [num_items] int32: sequence of each query tile
    work_q_first: torch.Tensor      # [num_items] int32: its first query within the sequence
    block_size: int
    num_tokens: int
    group: int
    tile: TileConfig
    num_splits: int                 # key-range splits (flash-decoding) per query tile


def choose_num_splits(num_programs: int, longest_kv: int, device: torch.device) -> int:
    """Split the keys only when the query tiles alone leave most of the GPU
    idle (a few long decodes): enough splits to give every SM about two
    programs, each at least 512 keys long."""
    if device.type != "cuda":
        return 1
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    if 2 * num_programs > sms:
        return 1
    return max(1, min(16, triton.cdiv(2 * sms, num_programs), longest_kv // 512))


def plan_attention(meta: AttentionMetadata, num_heads: int, num_kv_heads: int,
                   device: torch.device | str, tile: TileConfig | None = None) -> AttentionPlan:
    device = torch.device(device)
    qsl, seq_lens, tables, bs = meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.block_size
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group = num_heads // num_kv_heads
    num_seqs = len(seq_lens)
    if len(qsl) != num_seqs + 1 or len(tables) != num_seqs or qsl[0] != 0:
        raise ValueError(f"AttentionMetadata: query_start_loc needs B+1={num_seqs + 1} entries starting at 0 and "
                         f"block_tables B={num_seqs} rows; got {len(qsl)} and {len(tables)}")
    q_lens = [qsl[b + 1] - qsl[b] for b in range(num_seqs)]
    for b in range(num_seqs):
        if not 1 <= q_lens[b] <= seq_lens[b]:
            raise ValueError(f"AttentionMetadata: sequence {b} has query length {q_lens[b]} and seq_len "
                             f"{seq_lens[b]}; need 1 <= query length <= seq_len")
        if len(tables[b]) * bs < seq_lens[b]:
            raise ValueError(f"AttentionMetadata.block_tables[{b}] has {len(tables[b])} blocks of {bs} tokens "
                             f"for seq_len {seq_lens[b]}; it needs ceil(seq_len / block_size) blocks")
    tile = tile or default_tile(max(q_lens), group, device)
    if group > tile.block_m:
        raise ValueError(f"TileConfig.block_m={tile.block_m} is smaller than the GQA group {group}")
    block_q = tile.block_m // group
    items = [(seq_lens[b] - q_lens[b] + min(first + block_q, q_lens[b]), b, first)
             for b in range(num_seqs) for first in range(0, q_lens[b], block_q)]
    items.sort(key=lambda it: -it[0])      # longest programs first: they set the makespan
    padded = meta.padded_block_table_array()
    width = padded.shape[1]
    # One host-to-device copy for all of it, then views.
    head = np.array(list(qsl) + list(seq_lens) + [it[1] for it in items] + [it[2] for it in items], dtype=np.int32)
    flat = torch.from_numpy(np.concatenate([head, padded.ravel()])).to(device)
    n = len(items)
    cuts = [num_seqs + 1, num_seqs, n, n, num_seqs * width]
    qsl_t, seq_t, ws_t, wq_t, bt_t = torch.split(flat, cuts)
    splits = tile.num_splits or choose_num_splits(n * num_kv_heads, items[0][0] if items else 0, device)
    return AttentionPlan(qsl_t, seq_t, bt_t.view(num_seqs, width), ws_t, wq_t, bs, qsl[-1], group, tile, splits)


def plan_decode(meta: DecodeMetadata, num_heads: int, num_kv_heads: int,
                tile: TileConfig | None = None) -> AttentionPlan:
    """The plan of a decode-only step from its device tensors alone, safe to
    capture in a CUDA graph: one query tile per sequence in batch order, and
    key splits chosen from the batch size and the static bound on the context
    (a split past a sequence's end does no work and weighs 0 in the merge)."""
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads={num_heads} is not a multiple of num_kv_heads={num_kv_heads}")
    group, device, num_seqs = num_heads // num_kv_heads, meta.seq_lens.device, meta.seq_lens.shape[0]
    tile = tile or default_tile(1, group, device)
    if group > tile.block_m:
        raise ValueError(f"TileConfig.block_m={tile.block_m} is smaller than the GQA group {group}")
    splits = tile.num_splits or choose_num_splits(num_seqs * num_kv_heads, meta.max_seq_len, device)
    return AttentionPlan(meta.query_start_loc, meta.seq_lens, meta.block_tables, meta.query_start_loc[:-1],
                         meta.first_query, meta.block_size, num_seqs, group, tile, splits)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, plan: AttentionPlan,
                    scale: float, out: torch.Tensor | None = None) -> torch.Tensor:
    """q [T, Hq, D], caches [num_blocks, block_size, Hkv, D] -> out [T, Hq, D] (q's dtype)."""
    if q.dim() != 3 or k_cache.dim() != 4:
        raise ValueError(f"q must be [T, Hq, D] and k_cache [num_blocks, block_size, Hkv, D]; "
                         f"got {tuple(q.shape)} and {tuple(k_cache.shape)}")
    num_tokens, num_heads, head_dim = q.shape
    _, block_size, num_kv_heads, cache_dim = k_cache.shape
    if v_cache.shape != k_cache.shape or v_cache.stride() != k_cache.stride():
        raise ValueError(f"v_cache {tuple(v_cache.shape)}/{v_cache.stride()} must match k_cache "
                         f"{tuple(k_cache.shape)}/{k_cache.stride()} in shape and strides")
    if cache_dim != head_dim or num_heads != plan.group * num_kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit the cache {tuple(k_cache.shape)} and the plan's "
                         f"GQA group {plan.group} (need Hq = group * Hkv and the same head_dim)")
    if num_tokens != plan.num_tokens or block_size != plan.block_size:
        raise ValueError(f"q has {num_tokens} tokens and the cache block_size {block_size}; the plan was built "
                         f"for {plan.num_tokens} tokens and block_size {plan.block_size}")
    if not (q.dtype == k_cache.dtype == v_cache.dtype) or q.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"q/k_cache/v_cache dtypes {q.dtype}/{k_cache.dtype}/{v_cache.dtype}: need one of "
                         "float32, float16, bfloat16, the same for all three")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head_dim (stride 1)")
    if not (q.device == k_cache.device == v_cache.device == plan.seq_lens.device):
        raise ValueError(f"q, caches and plan must share a device; got {q.device}, {k_cache.device}, "
                         f"{plan.seq_lens.device}")
    if out is None:
        out = torch.empty_like(q)
    num_items = plan.work_seq.numel()
    if num_items == 0:
        return out
    check_runnable(_paged_attention_kernel, q.device)
    interpreted = q.device.type != "cuda"
    t, splits = plan.tile, plan.num_splits
    block_d = triton.next_power_of_2(max(head_dim, 16))
    part = lse = out                # unused without splits
    if splits > 1:
        part = torch.empty(splits, num_tokens, num_heads, head_dim, device=q.device, dtype=torch.float32)
        lse = torch.empty(splits, num_tokens, num_heads, device=q.device, dtype=torch.float32)
    _paged_attention_kernel[(num_items * num_kv_heads * splits,)](
        out, q, k_cache, v_cache,
        plan.block_tables, plan.seq_lens, plan.query_start_loc, plan.work_seq, plan.work_q_first,
        part, lse,
        scale * LOG2E, num_kv_heads, num_heads, num_tokens,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        plan.block_tables.stride(0),
        BLOCK_SIZE=block_size, GROUP=plan.group, HEAD_DIM=head_dim,
        BLOCK_D=block_d, BLOCK_M=t.block_m, BLOCK_Q=t.block_m // plan.group, BLOCK_N=t.block_n,
        DOT_FP32=interpreted,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        NUM_SPLITS=splits,
        num_warps=t.num_warps, num_stages=t.num_stages,
    )
    if splits > 1:
        rows = num_tokens * num_heads
        block_r = 16 if not interpreted else triton.next_power_of_2(rows)
        _combine_splits_kernel[(triton.cdiv(rows, block_r),)](
            out, part, lse, rows, num_heads, out.stride(0), out.stride(1),
            NUM_SPLITS=splits, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_R=block_r, num_warps=4)
    return out
