"""Triton paged attention and the flash-attn backend against kernels/reference.py.

Without a GPU the kernel runs in Triton's interpreter (slow per program and
per loop iteration), so the cases are small and use big tiles; the same cases
run compiled on CUDA (marked gpu) where a GPU is present."""
from __future__ import annotations

import os
import random

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is first imported

from testbed.kernels.attention import AttentionMetadata, get_attention_backend   # noqa: E402
from testbed.kernels.reference import ref_paged_attention                        # noqa: E402
from testbed.kernels.torch_backend import TorchAttentionBackend                  # noqa: E402
from testbed.kernels.triton_attention import (TileConfig, paged_attention,       # noqa: E402
                                               plan_attention)
from testbed.kernels.triton_backend import TritonAttentionBackend                # noqa: E402

HAS_CUDA = torch.cuda.is_available()
DEVICES = [
    pytest.param("cpu", marks=pytest.mark.skipif(HAS_CUDA, reason="on a GPU machine the kernels are compiled "
                                                 "for CUDA; the interpreter runs them where there is no GPU")),
    pytest.param("cuda", marks=[pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")]),
]
TOL = {torch.float32: 2e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def make_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device,
              spare_blocks=5, seed=0):
    """Random q and a two-layer engine-shaped cache [layers, 2, blocks, block_size, Hkv, D] whose layer 1
    holds the sequences in shuffled (non-contiguous) blocks; returns layer-1 views like the engine's."""
    gen = torch.Generator().manual_seed(seed)
    need = [-(-s // block_size) for s in seq_lens]
    num_blocks = sum(need) + spare_blocks
    ids = torch.randperm(num_blocks, generator=gen).tolist()
    tables = []
    for n in need:
        tables.append(ids[:n])
        ids = ids[n:]
    qsl = [0]
    for n in q_lens:
        qsl.append(qsl[-1] + n)
    cache = torch.randn(2, 2, num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    q = torch.randn(qsl[-1], num_heads, head_dim, generator=gen).to(dtype).to(device)
    meta = AttentionMetadata(qsl, list(seq_lens), tables, torch.zeros(qsl[-1], dtype=torch.long), block_size)
    return q, cache[1, 0], cache[1, 1], meta


def check(q_lens, seq_lens, num_heads=4, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32,
          device="cpu", tile=None):
    q, k, v, meta = make_case(q_lens, seq_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device)
    scale = head_dim ** -0.5
    plan = plan_attention(meta, num_heads, num_kv_heads, device, tile)
    out = paged_attention(q, k, v, plan, scale)
    ref = ref_paged_attention(q.cpu(), k.cpu(), v.cpu(), meta.query_start_loc, meta.seq_lens,
                              meta.block_tables, scale)
    assert out.dtype == dtype and out.shape == q.shape
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])
    return plan


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_mixed_batch_in_one_launch(device, dtype):
    # decode, chunk crossing block boundaries mid-context, context of 1, whole prompt
    q_lens = [1, 37, 1, 20]
    plan = check(q_lens, [300, 100, 1, 20], num_heads=8, num_kv_heads=2, dtype=dtype, device=device)
    # one program per query tile: a tile holds block_m rows of (query, head-in-group)
    rows_per_tile = plan.tile.block_m // plan.group
    assert sorted(plan.work_seq.tolist()) == [b for b, n in enumerate(q_lens) for _ in range(-(-n // rows_per_tile))]
    assert plan.num_splits == 1 or device == "cuda"


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_head_dims(device, head_dim):
    check([1, 24], [50, 70], num_heads=4, num_kv_heads=2, head_dim=head_dim, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_head_dim_not_power_of_two(device):
    check([3, 1], [40, 33], num_heads=2, num_kv_heads=1, head_dim=80, device=device)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("group", [1, 4, 8])
def test_gqa_ratios(device, group):
    check([5, 1], [45, 90], num_heads=2 * group, num_kv_heads=2, dtype=torch.float16, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_non_power_of_two_group(device):
    # yi-34b shares each KV head among 7 query heads
    check([6, 1], [30, 19], num_heads=7, num_kv_heads=1, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_context_of_one(device):
    check([1], [1], device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_many_blocks(device):
    # 1000 tokens in 250 shuffled blocks of 4: a KV tile spans 64 blocks
    check([1, 9], [1000, 777], block_size=4, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_key_tile_not_aligned_to_blocks(device):
    # blocks of 12 tokens under 16-key tiles: tiles straddle blocks at odd offsets
    check([1, 19], [77, 61], block_size=12, device=device, tile=TileConfig(block_m=32, block_n=16))


@pytest.mark.parametrize("device", DEVICES)
def test_many_query_tiles_and_key_tiles(device):
    # 16-row tiles of 4 queries x GQA 4: a 45-query chunk is 12 programs, each walking
    # unmasked 16-key tiles over the prefix and masked ones across its own diagonal.
    # Lengths put a tile's first query (and a decode) one key short of a tile edge.
    plan = check([45, 1, 18], [110, 47, 20], num_heads=4, num_kv_heads=1, device=device,
                 tile=TileConfig(block_m=16, block_n=16))
    assert plan.work_seq.numel() == 12 + 1 + 5
    # longest programs first: sequence 0's last tile (all 110 keys) leads
    assert plan.work_seq[0].item() == 0 and plan.work_q_first[0].item() == 44


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_key_splits(device, dtype):
    # flash-decoding: 3 splits of a 16-key-tile range; the 20-query chunk's first rows
    # (positions 10..15) see no key of its second split [16, 30) and must weigh 0 there
    plan = check([1, 1, 20], [100, 7, 30], num_heads=8, num_kv_heads=2, dtype=dtype, device=device,
                 tile=TileConfig(block_m=64, block_n=16, num_splits=3))
    assert plan.num_splits == 3


def test_plan_rejects_bad_metadata():
    meta = AttentionMetadata([0, 3], [10], [[0]], torch.zeros(3, dtype=torch.long), 4)
    with pytest.raises(ValueError, match=r"block_tables\[0\] has 1 blocks"):
        plan_attention(meta, 4, 1, "cpu")
    meta = AttentionMetadata([0, 5], [4], [[0]], torch.zeros(5, dtype=torch.long), 4)
    with pytest.raises(ValueError, match="query length 5 and seq_len 4"):
        plan_attention(meta, 4, 1, "cpu")
    with pytest.raises(ValueError, match="num_kv_heads=3"):
        plan_attention(meta, 4, 3, "cpu")
    with pytest.raises(ValueError, match="power of two"):
        TileConfig(block_m=24, block_n=16)


def test_plan_pads_ragged_block_tables_with_block_zero():
    # a long chunk beside short decodes: the rows keep their blocks in order, the rest is 0
    tables = [[7, 3, 9, 11, 5], [2], [4, 8]]
    meta = AttentionMetadata([0, 2, 3, 4], [20, 3, 6], tables, torch.zeros(4, dtype=torch.long), 4)
    plan = plan_attention(meta, 4, 1, "cpu")
    assert plan.block_tables.tolist() == [[7, 3, 9, 11, 5], [2, 0, 0, 0, 0], [4, 8, 0, 0, 0]]
    assert plan.block_tables.dtype == torch.int32
    assert plan.seq_lens.tolist() == [20, 3, 6] and plan.query_start_loc.tolist() == [0, 2, 3, 4]
    assert meta.padded_block_tables().tolist() == plan.block_tables.tolist()


def test_kernel_rejects_mismatched_tensors():
    q, k, v, meta = make_case([2], [9], 4, 1, 64, 4, torch.float32, "cpu")
    plan = plan_attention(meta, 4, 1, "cpu")
    with pytest.raises(ValueError, match="dtypes"):
        paged_attention(q.half(), k, v, plan, 0.1)
    with pytest.raises(ValueError, match="GQA group"):
        paged_attention(q[:, :2], k, v, plan, 0.1)
    with pytest.raises(ValueError, match="v_cache"):
        paged_attention(q, k, v[:-1], plan, 0.1)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_matches_torch_backend_and_reuses_its_plan(device):
    q, k, v, meta = make_case([1, 13, 1], [33, 50, 8], 8, 2, 32, 16, torch.float32, device)
    backend = get_attention_backend("triton")
    assert isinstance(backend, TritonAttentionBackend) and backend.name == "triton"
    out = backend.forward(q, k, v, meta, 0.2)
    plan = backend._plan
    backend.forward(q, k, v, meta, 0.2)                 # the next layer of the same step
    assert backend._plan is plan
    expected = TorchAttentionBackend().forward(q.cpu(), k.cpu(), v.cpu(), meta, 0.2)
    torch.testing.assert_close(out.cpu(), expected, atol=2e-5, rtol=2e-5)
    meta2 = AttentionMetadata(meta.query_start_loc, [34, 51, 9], meta.block_tables, meta.slot_mapping, 16)
    backend.forward(q, k, v, meta2, 0.2)                # the next step
    assert backend._plan is not plan


def test_torch_backend_groups_decodes_by_length(monkeypatch):
    """Decodes of very different lengths go to separate padded SDPA calls
    (each padding at most doubles its work), in any order in the batch, and
    every row still equals the reference."""
    calls = []
    backend = TorchAttentionBackend()
    group = backend._decode_group
    monkeypatch.setattr(backend, "_decode_group", lambda *a: calls.append(sorted(a[5])) or group(*a))
    q_lens, seq_lens = [1, 1, 9, 1, 1, 1], [700, 20, 40, 25, 17, 650]
    q, k, v, meta = make_case(q_lens, seq_lens, 4, 1, 32, 16, torch.float32, "cpu")
    out = backend.forward(q, k, v, meta, 0.2)
    ref = ref_paged_attention(q, k, v, meta.query_start_loc, meta.seq_lens, meta.block_tables, 0.2)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    assert calls == [[1, 3, 4], [0, 5]]       # 17-25 tokens together, 650-700 together; the chunk alone


@pytest.mark.parametrize("q_lens, seq_lens, budget_bytes, expected", [
    ([1] * 8, [40] * 8, 4 << 20, (0, 1)),                            # like lengths: one call
    ([1] * 8, [40] * 8, 64 << 10, (0, 4)),                           # ... split by the budget: 2 x 48 tokens a call
    ([1, 1, 9, 1, 1, 1], [700, 20, 40, 25, 17, 650], 4 << 20, (1, 2)),   # two decode groups and a chunk
    ([1], [300], 4 << 20, (1, 0)), ([64, 1], [64, 90], 4 << 20, (2, 0)),  # a lone decode runs on its own
    ([1] * 24, [64 + 40 * i for i in range(24)], 4 << 20, (0, 5)),   # spread: by doubling, then 8K tokens a call
])
def test_attention_calls_counts_the_backends_sdpa_calls(monkeypatch, q_lens, seq_lens, budget_bytes, expected):
    """What the cost model counts (attention_calls: calls on one sequence,
    batched decode calls, those of them with a mask, the padded keys) is what
    the backend does: one SDPA call per prefill slice and per decode group,
    each group padded to its longest decode and masked when lengths differ."""
    from testbed.kernels import torch_backend
    from testbed.kernels.decode_groups import attention_calls
    sdpa, made = torch_backend.F.scaled_dot_product_attention, []
    monkeypatch.setattr(torch_backend.F, "scaled_dot_product_attention",
                        lambda *a, **kw: made.append(kw.get("attn_mask") is not None) or sdpa(*a, **kw))
    backend, groups = TorchAttentionBackend(), []
    group = backend._decode_group
    monkeypatch.setattr(backend, "_decode_group", lambda *a: groups.append([a[3].seq_lens[b] for b in a[5]])
                        or group(*a))
    monkeypatch.setattr(TorchAttentionBackend, "cpu_decode_group_bytes", budget_bytes)
    q, k, v, meta = make_case(q_lens, seq_lens, 4, 2, 32, 16, torch.float32, "cpu")
    backend.forward(q, k, v, meta, 0.2)
    per_token = 2 * 2 * 32 * 4                                       # K and V, 2 KV heads of 32 floats
    calls = attention_calls(list(zip(q_lens, seq_lens)), 16, budget_bytes // per_token)
    assert (calls.single, calls.batched) == expected
    assert len(made) == sum(expected) and len(groups) == calls.batched
    # the backend runs the decode groups first: their SDPA calls carry a mask exactly when lengths differ
    assert calls.masked == sum(min(g) != max(g) for g in groups) == sum(made[:calls.batched])
    assert calls.padding == sum(len(g) * max(g) - sum(g) for g in groups)


def test_flash_attn_missing_is_named():
    try:
        import flash_attn  # noqa: F401
    except ModuleNotFoundError:
        with pytest.raises(ValueError, match="needs the package 'flash_attn'"):
            get_attention_backend("flash_attn")
    else:
        pytest.skip("flash_attn is installed here")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("block_size", [16, 256])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_flash_attn_backend(block_size, dtype):
    pytest.importorskip("flash_attn", reason="flash-attn is not installed")
    q, k, v, meta = make_case([1, 37, 300, 1], [900, 100, 300, 2], 8, 2, 128, block_size, dtype, "cuda")
    out = get_attention_backend("flash_attn").forward(q, k, v, meta, 128 ** -0.5)
    ref = ref_paged_attention(q.cpu(), k.cpu(), v.cpu(), meta.query_start_loc, meta.seq_lens,
                              meta.block_tables, 128 ** -0.5)
    torch.testing.assert_close(out.cpu().float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_long_context_on_gpu():
    # what the engine meets: 16-token blocks, a 1K chunk over a 5K prefix, 8 decodes, llama3-8b heads
    random.seed(0)
    decodes = [random.randint(1, 5000) for _ in range(8)]
    plan = check([1024] + [1] * 8, [6144] + decodes, num_heads=32, num_kv_heads=8, head_dim=128,
                 dtype=torch.bfloat16, device="cuda")
    assert plan.tile.block_m == 128 and plan.num_splits == 1


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CUDA, reason="needs a CUDA GPU")
def test_few_long_decodes_split_keys_on_gpu():
    # 2 decodes x 8 KV heads = 16 programs: far fewer than SMs, so the plan splits the keys
    plan = check([1, 1], [5000, 3001], num_heads=32, num_kv_heads=8, head_dim=128,
                 dtype=torch.bfloat16, device="cuda")
    assert plan.num_splits > 1
