"""The real engine (tiny preset, fp32, torch attention) end to end: chunked
prefill equals monolithic prefill, a mixed batch equals each request alone,
prefix-cache hits compute fewer tokens for the same output, all schedulers
agree, preemption by recompute and aborts give every block back, seeded
sampling does not depend on the batch, and the EOS switch stops generation.

Logits are recorded as the executor computes them for sampling (a spy around
`model.compute_logits` that returns the real result), so "same final logits"
is checked on the engine's own path, not on a side computation."""
from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

from testbed.block_manager import BlockManager
from testbed.engine import Engine, WallClock
from testbed.metrics import IterationRecord
from testbed.kernels.attention import AttentionMetadata
from testbed.kernels.reference import ref_paged_attention
from testbed.kernels.torch_backend import TorchAttentionBackend
from testbed.model.config import load_model_preset
from testbed.model_executor import ModelExecutor
from testbed.request import Request, RequestStatus, SamplingParams
from testbed.schedulers import SCHEDULERS, SchedulerConfig, SchedulerContext, make_scheduler
from testbed.sim.config import load_hardware_preset
from testbed.sim.cost_model import CostModel

BLOCK_SIZE = 16
LOGIT_TOL = 1e-4      # fp32, 4 layers; observed differences are ~1e-5
KV_TOL = 1e-5
VOCAB = 4096

torch.set_num_threads(1)


def prompt(n: int, seed: int) -> list[int]:
    return torch.randint(0, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


@dataclass
class Run:
    tokens: dict[str, list[int]] = field(default_factory=dict)
    logits: dict[str, list[torch.Tensor]] = field(default_factory=dict)   # one [vocab] row per sampled token
    iterations: list[IterationRecord] = field(default_factory=list)
    kv: dict[str, torch.Tensor] = field(default_factory=dict)             # last seen KV, token order
    num_preemptions: int = 0


class Harness:
    """An engine over the tiny preset, with the sampled logits recorded."""

    def __init__(self, scheduler: str = "sarathi", token_budget: int = 4096, num_blocks: int = 128,
                 enable_prefix_caching: bool = True, max_num_seqs: int = 16, max_num_batched_tokens: int = 4096):
        self.bm = BlockManager(num_blocks, BLOCK_SIZE, enable_prefix_caching)
        cfg = SchedulerConfig(token_budget=token_budget, max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=max_num_batched_tokens)
        clock = WallClock()
        context = None
        if SCHEDULERS[scheduler].needs_predictor:     # the cost model of this CPU, as runtime=real builds it
            predictor = CostModel(load_model_preset("tiny"), load_hardware_preset("cpu"))
            context = SchedulerContext(clock, 2000.0, 100.0, predictor)
        self.scheduler = make_scheduler(scheduler, cfg, self.bm, context)
        self.ex = ModelExecutor(load_model_preset("tiny"), num_blocks, BLOCK_SIZE, self.bm.block_table)
        self.engine = Engine(self.scheduler, self.ex, clock)
        self._last_logits: torch.Tensor | None = None
        compute_logits = self.ex.model.compute_logits

        def spy(hidden: torch.Tensor) -> torch.Tensor:
            self._last_logits = compute_logits(hidden)
            return self._last_logits
        self.ex.model.compute_logits = spy
        self.run_ = Run()

    def gather_kv(self, request_id: str, num_tokens: int) -> torch.Tensor:
        """The request's KV in token order: [num_layers, 2, num_tokens, Hkv, D]."""
        table = torch.tensor(self.bm.block_table(request_id), dtype=torch.long)
        blocks = self.ex.kv_cache.index_select(2, table)                  # [L, 2, n, block_size, Hkv, D]
        return blocks.flatten(2, 3)[:, :, :num_tokens].clone()

    def step(self) -> None:
        self._last_logits = None
        out = self.engine.step()
        assert out is not None
        self.run_.iterations.append(out.iteration)
        # rows of the logits follow the sampling slices, as do new_tokens
        assert (self._last_logits is None) == (not out.new_tokens)
        for row, (req, token) in enumerate(out.new_tokens):
            self.run_.tokens.setdefault(req.request_id, []).append(token)
            self.run_.logits.setdefault(req.request_id, []).append(self._last_logits[row])
            assert token == req.output_token_ids[-1]
        for req in self.scheduler.running:
            if self.bm.block_table(req.request_id):
                self.run_.kv[req.request_id] = self.gather_kv(req.request_id, req.num_computed_tokens)

    def run(self, requests: list[Request]) -> Run:
        for r in requests:
            self.engine.add_request(r)
        while self.engine.has_work():
            self.step()
        self.run_.num_preemptions = self.scheduler.num_preemptions
        self.bm.check_invariants()
        assert self.bm.all_free(), "blocks still held after every request finished"
        for r in requests:
            assert r.status == RequestStatus.FINISHED
            assert self.run_.tokens[r.request_id] == r.output_token_ids
        return self.run_


def alone(p: list[int], max_tokens: int, rid: str = "r", sampling: SamplingParams | None = None) -> Run:
    return Harness().run([Request(rid, p, max_tokens, sampling=sampling or SamplingParams())])


def assert_same_outputs(got: Run, ref: Run, ids) -> None:
    for rid in ids:
        diverged = next((i for i, (a, b) in enumerate(zip(got.tokens[rid], ref.tokens[rid])) if a != b), None)
        if diverged is not None:
            # a flip at a near tie is fp32 rounding, not a bug: the message says which
            top = torch.topk(ref.logits[rid][diverged], 2).values
            pytest.fail(f"{rid}: token {diverged} differs ({got.tokens[rid][diverged]} vs {ref.tokens[rid][diverged]}); "
                        f"reference top-2 logit margin there {float(top[0] - top[1]):.2e}")
        assert got.tokens[rid] == ref.tokens[rid], rid
        torch.testing.assert_close(torch.stack(got.logits[rid]), torch.stack(ref.logits[rid]),
                                   atol=LOGIT_TOL, rtol=LOGIT_TOL)


# ---- the attention backend the engine runs on ------------------------------------------

@pytest.mark.parametrize("group_bytes", [None, 1, 20_000])
def test_torch_backend_against_reference(group_bytes):
    """One backend instance over calls that grow and shrink (its gather buffers
    are reused across calls): decodes of unequal and equal lengths, a chunk
    after a cached prefix, a whole prompt, GQA 8:2, shuffled block tables.
    Batched decodes are cut into groups by KV bytes: default (one group here),
    one request per group, and groups of about 2 requests."""
    gen = torch.Generator().manual_seed(0)
    num_blocks, hq, hkv, d = 40, 8, 2, 32
    k_cache, v_cache = (torch.randn(num_blocks, BLOCK_SIZE, hkv, d, generator=gen) for _ in range(2))
    backend = TorchAttentionBackend()
    if group_bytes is not None:
        backend.cpu_decode_group_bytes = group_bytes
    for q_lens, seq_lens in [([1, 1, 1], [17, 50, 3]), ([40], [40]), ([1, 1], [33, 33]),
                             ([1, 1, 7, 1], [120, 9, 70, 64]), ([1, 1, 1], [5, 16, 2]), ([16, 1], [160, 1])]:
        perm = torch.randperm(num_blocks, generator=gen).tolist()
        tables, used = [], 0
        for n in seq_lens:
            need = -(-n // BLOCK_SIZE)
            tables.append(perm[used:used + need])
            used += need
        cu = [0]
        for n in q_lens:
            cu.append(cu[-1] + n)
        q = torch.randn(cu[-1], hq, d, generator=gen)
        meta = AttentionMetadata(cu, seq_lens, tables, torch.zeros(cu[-1], dtype=torch.long), BLOCK_SIZE)
        torch.testing.assert_close(backend.forward(q, k_cache, v_cache, meta, 0.3),
                                   ref_paged_attention(q, k_cache, v_cache, cu, seq_lens, tables, 0.3),
                                   atol=2e-5, rtol=2e-5)


# ---- chunked prefill -------------------------------------------------------------

@pytest.mark.parametrize("prompt_len", [37, 100, 129])
def test_chunked_prefill_equals_monolithic(prompt_len):
    """Chunks of 1, 7, 16 and 64 (crossing block boundaries at every offset
    mod 16) give the monolithic prefill's first-token logits, the same 8
    tokens, and the same KV cache contents, prompt and decodes."""
    p = prompt(prompt_len, seed=prompt_len)
    whole = Harness(token_budget=prompt_len).run([Request("r", p, max_tokens=8)])
    assert len(whole.iterations) == 8 and whole.iterations[0].num_prefill_tokens == prompt_len
    for chunk in (1, 7, 16, 64):
        got = Harness(token_budget=chunk).run([Request("r", p, max_tokens=8)])
        assert [it.num_prefill_tokens for it in got.iterations if it.num_prefill_tokens] == \
            [min(chunk, prompt_len - s) for s in range(0, prompt_len, chunk)]
        assert got.tokens["r"] == whole.tokens["r"], f"chunk={chunk}"
        torch.testing.assert_close(got.logits["r"][0], whole.logits["r"][0], atol=LOGIT_TOL, rtol=LOGIT_TOL)
        assert_same_outputs(got, whole, ["r"])
        assert got.kv["r"].shape[2] == prompt_len + 6      # the last step frees the blocks
        torch.testing.assert_close(got.kv["r"], whole.kv["r"], atol=KV_TOL, rtol=KV_TOL)


def test_mixed_batch_equals_each_request_alone():
    """Three requests decoding while a fourth is prefilled in chunks beside
    them, in the same iterations."""
    lens, max_tokens = [20, 33, 50], 10
    prompts = {f"d{i}": prompt(n, seed=10 + i) for i, n in enumerate(lens)}
    prompts["c"] = prompt(90, seed=20)
    h = Harness(token_budget=24)
    for rid in ("d0", "d1", "d2"):
        h.engine.add_request(Request(rid, prompts[rid], max_tokens))
    while any(r.is_prefill for r in list(h.scheduler.waiting) + h.scheduler.running):
        h.step()
    chunked = Request("c", prompts["c"], max_tokens)
    h.engine.add_request(chunked)
    while h.engine.has_work():
        h.step()
    assert h.bm.all_free()
    mixed = [it for it in h.run_.iterations if it.num_decode_tokens == 3 and it.num_prefill_tokens > 0]
    assert len(mixed) >= 3, "the chunk never shared an iteration with the three decodes"
    assert all(it.num_prefill_tokens + it.num_decode_tokens <= 24 for it in h.run_.iterations)
    for rid, p in prompts.items():
        assert_same_outputs(h.run_, alone(p, max_tokens, rid), [rid])


def test_decodes_of_equal_and_unequal_lengths_batch_like_alone():
    """Batched decodes gather every request's blocks into one padded tensor:
    equal context lengths (nothing to mask) and lengths 1 apart, 15 apart and
    across a block boundary (padding masked) all give each request's solo outputs."""
    lens = {"a": 40, "b": 40, "c": 41, "d": 55, "e": 17}
    prompts = {rid: prompt(n, seed=30 + i) for i, (rid, n) in enumerate(lens.items())}
    for group in (["a", "b"], list(lens)):
        got = Harness().run([Request(rid, prompts[rid], 6) for rid in group])
        assert max(it.num_decode_tokens for it in got.iterations) == len(group)
        for rid in group:
            assert_same_outputs(got, alone(prompts[rid], 6, rid), [rid])


# ---- prefix caching ------------------------------------------------------------------

@pytest.mark.parametrize("second_len,expected_computed", [(94, 30), (84, 4), (80, 16)])
def test_prefix_cache_hit_computes_fewer_tokens_same_output(second_len, expected_computed):
    """The second request shares the first one's prefix. 94: 64 shared tokens,
    then a different suffix. 84: the same prompt; its 5 full blocks hit, the
    last 4 tokens are computed. 80: a prompt ending on a block boundary; a hit
    never covers the last token (a step must sample from it), so the 5th block
    is recomputed."""
    first = prompt(84, seed=1)
    second = first[:64] + prompt(second_len - 64, seed=2) if second_len == 94 else first[:second_len]
    runs = {}
    for caching in (True, False):
        h = Harness(enable_prefix_caching=caching)
        h.run([Request("a", first, max_tokens=6)])
        n_before = len(h.run_.iterations)
        h.run([Request("b", second, max_tokens=6)])
        runs[caching] = (sum(it.num_prefill_tokens for it in h.run_.iterations[n_before:]), h.run_)
    assert runs[False][0] == second_len
    assert runs[True][0] == expected_computed
    assert_same_outputs(runs[True][1], runs[False][1], ["a", "b"])


# ---- schedulers, budget, preemption ----------------------------------------------------

WORKLOAD = [(23, 6), (50, 4), (9, 8), (70, 5), (33, 7)]   # (prompt_len, max_tokens)


def workload() -> list[Request]:
    return [Request(f"r{i}", prompt(n, seed=100 + i), m) for i, (n, m) in enumerate(WORKLOAD)]


@pytest.fixture(scope="module")
def reference_run() -> Run:
    """Every request alone, whole prefill."""
    ref = Run()
    for r in workload():
        solo = alone(list(r.prompt_token_ids), r.max_tokens, r.request_id)
        ref.tokens.update(solo.tokens)
        ref.logits.update(solo.logits)
    return ref


@pytest.mark.parametrize("scheduler", sorted(SCHEDULERS))
def test_schedulers_generate_the_same_tokens(scheduler, reference_run):
    got = Harness(scheduler, token_budget=32, max_num_batched_tokens=128).run(workload())
    assert_same_outputs(got, reference_run, [f"r{i}" for i in range(len(WORKLOAD))])
    assert got.num_preemptions == 0
    assert len(got.iterations) < sum(m for _, m in WORKLOAD)   # fewer than one request at a time would take


@pytest.mark.parametrize("budget", [1, 7, 32])
def test_sarathi_never_exceeds_token_budget(budget):
    got = Harness("sarathi", token_budget=budget).run(workload())
    sizes = [it.num_prefill_tokens + it.num_decode_tokens for it in got.iterations]
    assert max(sizes) == budget                                 # the budget is used, and never exceeded
    assert sum(sizes) == sum(n + m - 1 for n, m in WORKLOAD)    # every token computed exactly once


PREEMPT_WORKLOAD = [(20, 40), (35, 30), (12, 45), (40, 25)]


def preempt_workload() -> list[Request]:
    return [Request(f"p{i}", prompt(n, seed=200 + i), m) for i, (n, m) in enumerate(PREEMPT_WORKLOAD)]


@pytest.mark.parametrize("scheduler,token_budget", [("sarathi", 5), ("sarathi", 32), ("vllm_v0", 32),
                                                     ("orca", 32)])
def test_preemption_by_recompute_keeps_outputs(scheduler, token_budget):
    """8 blocks of 16 slots for four requests that need 4-5 blocks each:
    requests are preempted, recomputed (prompt and outputs so far) and still
    produce the tokens and logits of an unconstrained run."""
    free = Harness(scheduler, token_budget=token_budget, max_num_batched_tokens=128).run(preempt_workload())
    assert free.num_preemptions == 0
    got = Harness(scheduler, token_budget=token_budget, num_blocks=8, max_num_batched_tokens=128).run(
        preempt_workload())
    assert got.num_preemptions > 0
    assert_same_outputs(got, free, [f"p{i}" for i in range(len(PREEMPT_WORKLOAD))])


def test_preemption_recompute_in_one_token_slices():
    """A budget of 2 with one request decoding leaves 1 token per iteration for
    the preempted request's recompute, so its earlier outputs come back as
    1-token slices that are not its last token (they once all read the last
    output token, corrupting the recomputed KV)."""
    def requests():
        return [Request("long", prompt(20, seed=300), 100), Request("victim", prompt(10, seed=301), 100)]
    free = Harness(token_budget=2).run(requests())
    h = Harness(token_budget=2, num_blocks=11, enable_prefix_caching=False)
    mid_output_slices = 0
    execute = h.ex.execute

    def count_and_execute(batch, on_layer_done=None):
        nonlocal mid_output_slices
        mid_output_slices += sum(sl.num_tokens == 1 and sl.request.prompt_len <= sl.start
                                 and sl.end < sl.request.num_tokens for sl in batch.slices)
        return execute(batch, on_layer_done)
    h.ex.execute = count_and_execute
    got = h.run(requests())
    assert got.num_preemptions == 1 and mid_output_slices >= 5
    assert_same_outputs(got, free, ["long", "victim"])


# ---- aborts -----------------------------------------------------------------------------

@pytest.mark.parametrize("when", ["waiting", "mid_prefill", "mid_decode"])
def test_abort_frees_blocks(when):
    h = Harness(token_budget=16)
    victim = Request("victim", prompt(100, seed=7), max_tokens=20)
    other = Request("other", prompt(30, seed=8), max_tokens=12)
    h.engine.add_request(other)
    h.engine.add_request(victim)
    if when == "mid_prefill":
        while victim.num_computed_tokens < 40:
            h.step()
        assert victim.is_prefill and h.bm.block_table("victim")
    elif when == "mid_decode":
        while victim.num_output_tokens < 3:
            h.step()
        assert h.bm.block_table("victim")
    held_by_other = len(h.bm.block_table("other"))
    assert h.engine.abort("victim") is victim
    assert victim.status == RequestStatus.ABORTED
    assert h.bm.block_table("victim") == []
    assert h.bm.num_used_blocks == held_by_other
    assert h.engine.abort("victim") is None            # a second abort finds nothing
    while h.engine.has_work():
        h.step()
    assert h.bm.all_free()
    h.bm.check_invariants()
    assert other.output_token_ids == alone(list(other.prompt_token_ids), 12).tokens["r"]


def test_a_prompt_that_never_fits_the_cache_is_refused_not_left_waiting():
    """An engine used on its own (no run controller to fail the request at
    arrival) refuses a prompt that needs more blocks than it has: queued, it
    would wait forever (has_work() true, every step empty)."""
    h = Harness(num_blocks=8)                                   # 8 x BLOCK_SIZE tokens of KV
    capacity = 8 * BLOCK_SIZE
    too_big = Request("big", prompt(capacity + 1, seed=9), max_tokens=1)
    with pytest.raises(ValueError, match=rf"request big: a prompt of {capacity + 1} tokens needs 9 KV blocks of "
                                          rf"{BLOCK_SIZE}, more than the engine's 8 \(num_kv_blocks\)"):
        h.engine.add_request(too_big)
    assert not h.engine.has_work() and h.bm.all_free()
    exact = Request("exact", prompt(capacity, seed=9), max_tokens=1)      # fills the cache exactly
    h.run([exact])
    assert exact.num_output_tokens == 1


# ---- sampling --------------------------------------------------------------------------

def test_seeded_sampling_is_independent_of_the_batch():
    sp = SamplingParams(temperature=1.0, top_p=0.9, seed=7)
    p = prompt(41, seed=3)
    solo = alone(p, 16, "x", sp).tokens["x"]
    h = Harness(token_budget=24)
    others = [Request("y", prompt(60, seed=4), 16, sampling=SamplingParams(temperature=0.7, top_p=0.5, seed=1)),
              Request("z", prompt(17, seed=5), 16)]
    batched = h.run(others[:1] + [Request("x", p, 16, sampling=sp)] + others[1:])
    assert batched.tokens["x"] == solo
    assert any(it.num_decode_tokens + it.num_prefill_tokens > 1 for it in batched.iterations)
    # the sampling is real: it leaves the greedy path, and another seed gives other tokens
    assert solo != alone(p, 16, "x").tokens["x"]
    assert solo != alone(p, 16, "x", SamplingParams(temperature=1.0, top_p=0.9, seed=8)).tokens["x"]


def test_top_p_keeps_only_the_nucleus():
    """With a tiny top_p only the top token survives: sampling equals greedy."""
    p = prompt(25, seed=6)
    assert alone(p, 12, "x", SamplingParams(temperature=1.0, top_p=1e-6, seed=3)).tokens["x"] == \
        alone(p, 12, "x").tokens["x"]


def test_eos_switch_stops_generation():
    p = prompt(30, seed=9)
    free_run = alone(p, 12).tokens["r"]
    stop_at = next(i for i in range(3, 12) if free_run[i] not in free_run[:i])
    eos = free_run[stop_at]
    stopped = alone(p, 12, sampling=SamplingParams(ignore_eos=False, eos_token_id=eos)).tokens["r"]
    assert stopped == free_run[:stop_at + 1]
    # by default EOS is ignored, as serving benchmarks do
    assert alone(p, 12, sampling=SamplingParams(eos_token_id=eos)).tokens["r"] == free_run
