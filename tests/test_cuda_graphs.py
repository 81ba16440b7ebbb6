"""CUDA-graph decode (testbed/model/cuda_graphs.py) without a GPU: which size a
batch pads to, and the padded forward run eagerly over the runner's static
buffers (what a graph replays) against the plain eager engine: the same
tokens in fp32, padding rows kept out of every request's KV blocks and out
of sampling, every block free at the end. On a GPU the same engine test
captures and replays real graphs (marked gpu)."""
from __future__ import annotations

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")      # before triton is first imported

from testbed.batch import Batch, ScheduledSlice                     # noqa: E402
from testbed.block_manager import BlockManager                      # noqa: E402
from testbed.engine import Engine, WallClock                        # noqa: E402
from testbed.kernels.attention import AttentionMetadata, DecodeMetadata  # noqa: E402
from testbed.kernels.reference import ref_paged_attention           # noqa: E402
from testbed.model.config import load_model_preset                  # noqa: E402
from testbed.sim.engine_overhead import VLLM_CUDA_GRAPH_SIZES as VLLM_CAPTURE_SIZES  # noqa: E402
from testbed.model.cuda_graphs import padded_size                   # noqa: E402
from testbed.model_executor import ModelExecutor                    # noqa: E402
from testbed.request import Request                                 # noqa: E402
from testbed.schedulers import SchedulerConfig, make_scheduler      # noqa: E402

BLOCK_SIZE = 8
NUM_BLOCKS = 48
SIZES = [1, 2, 4, 8]

torch.set_num_threads(1)


def test_padded_size_is_the_next_captured_size():
    assert VLLM_CAPTURE_SIZES[:5] == [1, 2, 4, 8, 16] and VLLM_CAPTURE_SIZES[-1] == 512
    assert len(VLLM_CAPTURE_SIZES) == 67
    assert [padded_size(b, VLLM_CAPTURE_SIZES) for b in (1, 2, 3, 4, 5, 8, 9, 31, 32, 33, 511, 512)] == \
        [1, 2, 4, 4, 8, 8, 16, 32, 32, 40, 512, 512]
    assert padded_size(513, VLLM_CAPTURE_SIZES) is None
    assert [padded_size(b, [4, 16]) for b in (1, 4, 5, 16, 17)] == [4, 4, 16, 16, None]


def generate(sizes: list[int], device: str = "cpu", backend: str = "torch",
             prompts: tuple[int, ...] = (23, 9, 37, 5, 17)) -> tuple[dict[str, list[int]], dict[int, int],
                                                                    ModelExecutor]:
    """Greedy tokens of the tiny model for `prompts` through the whole engine,
    and how many decode-only steps of each batch size ran."""
    bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
    sched = make_scheduler("sarathi", SchedulerConfig(token_budget=32, max_num_seqs=8,
                                                      max_num_batched_tokens=64), bm)
    executor = ModelExecutor(load_model_preset("tiny"), NUM_BLOCKS, BLOCK_SIZE, bm.block_table, backend, device,
                             cuda_graph_sizes=sizes)
    engine = Engine(sched, executor, WallClock())
    gen = torch.Generator().manual_seed(3)
    requests = [Request(f"r{i}", torch.randint(0, 4096, (n,), generator=gen).tolist(), max_tokens=6 + i)
                for i, n in enumerate(prompts)]
    for r in requests:
        engine.add_request(r)
    decode_steps: dict[int, int] = {}
    while engine.has_work():
        out = engine.step()
        if out.iteration.num_prefill_tokens == 0:
            decode_steps[out.iteration.num_decode_tokens] = decode_steps.get(out.iteration.num_decode_tokens, 0) + 1
    assert bm.all_free()                    # no block leaked, padded steps included
    return {r.request_id: r.output_token_ids for r in requests}, decode_steps, executor


def test_padded_decode_steps_give_the_eager_tokens():
    expected, steps, _ = generate([])
    got, padded_steps, executor = generate(SIZES)
    assert steps == padded_steps
    # decode-only steps of 3, 4 and 5 requests: padded to 4, 4 and 8
    assert {3, 5} <= set(steps) and max(steps) <= SIZES[-1]
    assert got == expected
    assert executor.kv_cache.shape[2] == NUM_BLOCKS + 1        # the scratch block


def test_a_batch_past_the_largest_size_runs_eagerly():
    expected, _, _ = generate([])
    got, steps, _ = generate([1, 2])       # 3-5 decodes: eager; 1-2: padded
    assert got == expected and max(steps) > 2


def test_padding_rows_touch_no_request_block_and_are_not_sampled():
    """One decode-only step of 3 requests padded to 4, against the same step
    eager: the same tokens; the requests' slots get the same K/V, every other
    block of the BlockManager keeps its bytes, and the padding row wrote the
    scratch block's first slot only."""
    model = load_model_preset("tiny")
    results = {}
    for sizes in ([], [4]):
        bm = BlockManager(NUM_BLOCKS, BLOCK_SIZE, enable_prefix_caching=False)
        ex = ModelExecutor(model, NUM_BLOCKS, BLOCK_SIZE, bm.block_table, cuda_graph_sizes=sizes)
        gen = torch.Generator().manual_seed(5)
        real = ex.kv_cache[:, :, :NUM_BLOCKS]
        real.copy_(torch.randn(real.shape, generator=gen))            # stands for other requests' KV
        before = ex.kv_cache.clone()
        slices = []
        for i, ctx in enumerate((12, 30, 7)):
            req = Request(f"r{i}", torch.randint(0, 4096, (ctx - 1,), generator=gen).tolist(), max_tokens=2)
            req.output_token_ids = [int(torch.randint(0, 4096, (1,), generator=gen))]
            req.num_computed_tokens = ctx - 1
            assert bm.allocate(req, ctx)
            slices.append(ScheduledSlice(req, 1))
        result = ex.execute(Batch(slices))
        written = torch.zeros(ex.kv_cache.shape[2], BLOCK_SIZE, dtype=torch.bool)
        for sl in slices:
            table, p = bm.block_table(sl.request.request_id), sl.start
            written[table[p // BLOCK_SIZE], p % BLOCK_SIZE] = True
        changed = (ex.kv_cache != before).any(-1).any(-1).any(0).any(0)           # [blocks, block_size]
        results[tuple(sizes)] = (result.sampled, ex.kv_cache[:, :, :NUM_BLOCKS][:, :, written[:NUM_BLOCKS]], changed,
                                 written)
    (eager_tokens, eager_kv, eager_changed, written), (tokens, kv, changed, _) = results[()], results[(4,)]
    assert tokens == eager_tokens and len(tokens) == 3
    torch.testing.assert_close(kv, eager_kv, rtol=1e-5, atol=1e-5)
    assert torch.equal(eager_changed, written)
    assert torch.equal(changed[:NUM_BLOCKS], written[:NUM_BLOCKS])            # only the requests' own slots
    assert changed[NUM_BLOCKS].tolist() == [True] + [False] * (BLOCK_SIZE - 1)   # padding: scratch slot 0


@pytest.mark.parametrize("backend,splits", [("torch", 0), ("triton", 0), ("triton", 4)])
def test_decode_metadata_attention_matches_the_reference(backend, splits):
    """forward_decode over DecodeMetadata (3 sequences and a padding row on the
    scratch block, tables wider than needed) equals the reference on the real
    rows; with 4 key splits (what a GPU picks from the static context bound)
    most splits of these short contexts hold no key."""
    from testbed.kernels.attention import get_attention_backend
    from testbed.kernels.triton_attention import TileConfig
    gen = torch.Generator().manual_seed(0)
    num_blocks, hq, hkv, d = 12, 4, 2, 32
    k_cache = torch.randn(num_blocks + 1, BLOCK_SIZE, hkv, d, generator=gen)
    v_cache = torch.randn(num_blocks + 1, BLOCK_SIZE, hkv, d, generator=gen)
    seq_lens, tables = [5, 17, 9], [[3], [0, 7, 2], [11, 4]]
    q = torch.randn(4, hq, d, generator=gen)
    width = num_blocks
    padded = [t + [num_blocks] * (width - len(t)) for t in tables] + [[num_blocks] * width]
    meta = DecodeMetadata(torch.tensor(seq_lens + [1], dtype=torch.int32), torch.tensor(padded, dtype=torch.int32),
                          torch.zeros(4, dtype=torch.long), torch.arange(5, dtype=torch.int32),
                          torch.zeros(4, dtype=torch.int32), BLOCK_SIZE)
    attention = get_attention_backend(backend)
    if splits:
        attention.tile = TileConfig(block_m=16, block_n=16, num_splits=splits)
    out = attention.forward_decode(q, k_cache, v_cache, meta, d ** -0.5)
    expected = ref_paged_attention(q[:3], k_cache, v_cache, [0, 1, 2, 3], seq_lens, tables, d ** -0.5)
    torch.testing.assert_close(out[:3], expected, rtol=1e-4, atol=1e-4)
    assert torch.isfinite(out[3]).all()
    eager = get_attention_backend(backend).forward(q[:3], k_cache, v_cache, AttentionMetadata(
        [0, 1, 2, 3], seq_lens, tables, torch.zeros(3, dtype=torch.long), BLOCK_SIZE), d ** -0.5)
    torch.testing.assert_close(out[:3], eager, rtol=1e-4, atol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_graph_replay_gives_the_eager_tokens_on_cuda():
    expected, steps, _ = generate([], "cuda", "triton")
    got, graph_steps, executor = generate(SIZES, "cuda", "triton")
    assert set(executor.graphs.graphs) == set(SIZES)            # captured, not run eagerly
    assert graph_steps == steps and got == expected


def test_the_run_config_turns_graphs_on_for_cuda_only():
    from testbed.config import RunConfig, validate
    from testbed.runtime.build import cuda_graph_sizes
    assert RunConfig().cuda_graphs and RunConfig().cuda_graph_sizes == VLLM_CAPTURE_SIZES
    assert cuda_graph_sizes(RunConfig()) == []                          # the CPU: eager, nothing changes
    on_gpu = RunConfig(device="cuda", attention_backend="triton", cuda_graph_sizes=[8, 1, 8, 4])
    assert cuda_graph_sizes(on_gpu) == [1, 4, 8]
    assert cuda_graph_sizes(RunConfig(device="cuda", cuda_graphs=False)) == []
    assert cuda_graph_sizes(RunConfig(device="cuda", cuda_graph_sizes=[])) == []
    # launcher=ray: the GPU is the worker nodes', not looked for here
    with pytest.raises(ValueError, match="^cuda_graphs: attention_backend=torch cannot replay"):
        validate(RunConfig(device="cuda", launcher="ray"))
    validate(RunConfig(device="cuda", launcher="ray", cuda_graphs=False))
    with pytest.raises(ValueError, match=r"^cuda_graph_sizes: decode batch sizes >= 1, got \[0, 8\]"):
        validate(RunConfig(cuda_graph_sizes=[0, 8]))
