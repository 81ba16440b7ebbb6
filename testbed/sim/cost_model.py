"""The executor's clock in `runtime=sim`: how long one engine iteration takes on
a given accelerator for a given batch, without running it.

A batch is a list of slices (num_new_tokens, context_len_after_this_step), one
per scheduled request: a decode is (1, ctx), a chunk of C tokens on a cached
prefix of P is (C, P + C), a whole prefill of L is (L, L). Per iteration:

- GEMMs over all m = Σ new tokens (qkv/o or the MLA projections, MLP or MoE
  router, shared and routed experts). On a preset with `gemm_table`, priced by
  shape from measured operator tables (gpu_tables.py), elementwise ops too;
  otherwise each max(compute, memory) with the weights streamed once per
  iteration (timers.py). lm_head runs only on the sampled rows.
- Attention per slice, from its query length and context: a chunk reads its
  whole prefix's KV again (the chunk re-read), a decode reads its context;
  priced by the preset's kernel (attention_kernels.py) or the roofline.
- Norms, residuals, rope, activations, embedding: memory-bound.
- TP: the per-GPU shapes (layer_shapes.py) plus two all-reduces of the
  hidden states per layer (after attention and after the MLP): from the
  preset's measured all-reduce table (collectives.py), else a ring on the
  intra-node link.
- PP: the batch crosses all pp stages in turn, so its latency is every layer's
  time plus pp-1 hand-offs of the hidden states. The engine runs one batch at a
  time, so each stage idles (pp-1)/pp of the iteration: the worst-case bubble.
  (An engine keeping pp batches in flight would start one every latency/pp.)
- The serving engine's part (engine=, engine_config.py, engine_overhead.py):
  its host time per iteration, added to the GPU's or overlapped with it; the
  eager kernel launches' lower bound; CUDA graphs (no launches, the tokens
  padded to the captured size); a custom all-reduce inside the graph.
  A profiled CPU also scales every other term by hardware.calibration_scale
  (its kernels inside the engine against the same kernels timed alone).

MoE: FLOPs count the routed tokens' active experts; bytes count the weights of
every expert the batch touches, expected_experts_touched() under uniform
routing (1-2 experts for one decode, all of them for a large batch).

Speed: everything that does not depend on the batch is precomputed; a short
batch is priced in plain Python, a long one with two numpy arrays (numpy's
call overhead pays only past a few dozen slices).
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

from testbed.model.config import ModelConfig
from testbed.sim.attention_kernels import KernelAttention, attention_kernel
from testbed.sim.collectives import AllReduceTable
from testbed.sim.config import HardwareConfig, ParallelConfig, load_link_preset
from testbed.sim.engine_config import EngineConfig, resolve_engine
from testbed.sim.engine_overhead import EngineOverhead
from testbed.sim.gpu_tables import GpuTablePricing
from testbed.sim.layer_shapes import expected_experts_touched, layer_shapes
from testbed.sim.link_model import LinkModel
from testbed.sim.timers import Curve, ProfiledAttention, ProfiledGemms, RooflineAttention, RooflineGemms

Slices = Sequence[tuple[int, int]] | np.ndarray
# Below this many slices an iteration is priced in plain Python: numpy's
# per-call overhead costs more than the arithmetic (the sim prices ~10^5
# iterations of a few slices each per run).
_SMALL_BATCH = 32


class CostModel:
    def __init__(self, model: ModelConfig, hardware: HardwareConfig, parallel: ParallelConfig | None = None,
                 engine: EngineConfig | None = None):
        """engine None (or engine=auto): the hardware's default engine (engine_config.resolve_engine)."""
        self.model, self.hardware = model, hardware
        self.engine = engine = resolve_engine(engine, hardware)
        self.parallel = parallel = parallel or ParallelConfig()
        hardware.validate()
        parallel.validate()
        self.shapes = shapes = layer_shapes(model, parallel.tp)
        self._s_per_flop = 1.0 / (hardware.peak_flops(model.dtype) * hardware.compute_efficiency)
        self._s_per_byte = 1.0 / (hardware.hbm_bw_gbps * 1e9 * hardware.memory_efficiency)
        # the layers' GEMMs run at their weights' dtype (fp8 weights: W8A8)
        self._layer_s_per_flop = 1.0 / (hardware.peak_flops(model.resolved_weight_dtype)
                                        * hardware.compute_efficiency)

        self._tables = GpuTablePricing(hardware, model, shapes) if hardware.gemm_table else None
        if self._tables:
            self._gemms_s = _remembered(self._tables.layers_curve())
            self._lm_head_s = _remembered(self._tables.lm_head_curve())
            self._elementwise_s = _remembered(self._tables.elementwise_curve())
        else:
            roofline = RooflineGemms(self._s_per_flop, self._s_per_byte, hardware.gemm_ramp_tokens,
                                     shapes.dtype_bytes)
            layers = RooflineGemms(self._layer_s_per_flop, self._s_per_byte, hardware.gemm_ramp_tokens,
                                   shapes.dtype_bytes, shapes.weight_dtype_bytes)
            if hardware.gemm_profile:
                if model.resolved_weight_dtype != model.dtype:
                    raise ValueError(f"model.weight_dtype: hardware '{hardware.name}' prices GEMMs from its profile "
                                     f"in {model.dtype} only; drop weight_dtype or use a GPU preset")
                roofline = layers = ProfiledGemms(hardware.gemm_profile)
            self._gemms_s = _remembered(layers.curve(shapes.gemms))
            self._lm_head_s = _remembered(roofline.curve([shapes.lm_head]))
            per_token = shapes.elementwise_bytes_per_token * self._s_per_byte
            self._elementwise_s = lambda m: m * per_token
        if hardware.attention_profile:
            self._attention = ProfiledAttention(shapes.attention, shapes.num_layers, hardware.attention_profile)
        elif engine.attention_kernel or hardware.attention_kernel:
            generation = hardware.gemm_table or "h100"
            kernel = attention_kernel(engine.attention_kernel, "engine.attention_kernel") \
                if engine.attention_kernel else None
            if kernel is None:
                kernel = attention_kernel(hardware.attention_kernel)
            elif generation not in kernel.peak_fraction:
                # the engine's kernel does not run on this chip (FA3 needs Hopper): vLLM runs
                # FlashAttention-2 there
                kernel = attention_kernel("flash_attn")
            self._attention = KernelAttention(shapes.attention, shapes.num_layers, kernel, generation,
                                              hardware.peak_flops(model.dtype), hardware.hbm_bw_gbps * 1e9)
        else:
            self._attention = RooflineAttention(shapes.attention, shapes.num_layers,
                                                self._s_per_flop, self._s_per_byte)
        self._engine = EngineOverhead.of(engine, shapes, parallel)
        self._scale = hardware.calibration_scale
        tp_link = load_link_preset(parallel.intra_node) if parallel.tp > 1 else None
        self._tp_link = LinkModel(tp_link) if tp_link else None
        self._tp_bytes_per_s = tp_link.bytes_per_s if tp_link else 0.0
        self._allreduce_table = (AllReduceTable(hardware.operator_tables_dir(), hardware.allreduce_table,
                                                 parallel.tp)
                                 if parallel.tp > 1 and hardware.allreduce_table
                                 and engine.tp_collective != "custom_allreduce" else None)
        self._pp_link = (LinkModel(load_link_preset(parallel.pp_link or parallel.intra_node))
                         if parallel.pp > 1 else None)
        self._counted: dict[tuple[float, int, int], tuple] = {}     # _counted_terms per counts

    # -- per-iteration cost --------------------------------------------------

    def iteration_time_s(self, slices: Slices, num_sampled: int | None = None) -> float:
        """Seconds for one iteration over `slices`; `num_sampled` rows go
        through lm_head (default: one per slice, as when every slice is a
        decode or a prompt's last chunk)."""
        # a Python float: an MoE's expert terms come back as numpy scalars, and these times
        # travel in messages whose decoder takes float and int only (runtime/wire.py)
        return float(sum(self._terms(slices, num_sampled)))

    def decode_iteration_s(self, num_decodes: int, context_tokens: int, longest_context: int) -> float | None:
        """iteration_time_s of `num_decodes` 1-token slices (each sampled) whose
        contexts sum to `context_tokens`, the longest `longest_context`, without
        the slices: the same float. None where the attention model needs each
        slice (only the kernel model prices decodes by their sum and longest)."""
        price = self.decode_pricer(num_decodes)
        return None if price is None else price(context_tokens, longest_context)

    def decode_pricer(self, num_decodes: int) -> Callable[[int, int], float] | None:
        """decode_iteration_s(num_decodes, context_tokens, longest_context) as a
        function of the last two, its batch-size terms looked up once (a
        DecodeRun prices its iterations with one)."""
        decode_seconds_of = getattr(self._attention, "decode_seconds_of", None)
        if decode_seconds_of is None:
            return None
        attention_s, scale = decode_seconds_of(num_decodes), self._scale
        gemm, experts, elementwise, lm_head, allreduce, pp, overhead, launch_bound, overlapped = self._counted_for(
            float(num_decodes), num_decodes, num_decodes)

        # _terms_of's float operations in its order, inlined: two calls fewer per
        # iteration (tests/test_sim_fast_forward.py compares it with iteration_time_s)
        def seconds(context_tokens: int, longest_context: int) -> float:
            attention = attention_s(context_tokens, longest_context)
            if scale != 1.0:
                attention *= scale
            terms = (gemm, experts, attention, elementwise, lm_head, allreduce, pp)
            if launch_bound is None and overlapped is None:
                return float(sum(terms + (overhead,)))
            return float(sum(terms + (_engine_s(terms, overhead, launch_bound, overlapped),)))
        return seconds

    def pricer_after(self, head: Sequence[tuple[int, int]]) -> Callable[[Sequence[tuple[int, int]], int], float]:
        """iteration_time_s(head + tail, num_sampled) as a function of tail and
        num_sampled, the same float, head's part of the attention priced once
        where the attention model allows (adaptive's budget search prices one
        set of decodes with many candidate chunks)."""
        head = list(head)
        after = getattr(self._attention, "seconds_after", None)
        if after is None:
            return lambda tail, num_sampled: self.iteration_time_s(head + list(tail), num_sampled)
        attention_after, head_m, num_head = after(head), _check_pairs(head), len(head)

        def price(tail: Sequence[tuple[int, int]], num_sampled: int) -> float:
            num_slices = num_head + len(tail)
            attention = attention_after(tail, not 0 < num_slices < _SMALL_BATCH) if num_slices else None
            if attention is None:
                return self.iteration_time_s(head + list(tail), num_sampled)
            m = float(head_m + _check_pairs(tail))
            return float(sum(self._with_counted(attention, m, num_sampled, num_slices)))
        return price

    def breakdown(self, slices: Slices, num_sampled: int | None = None) -> dict[str, float]:
        """The iteration's seconds by part (keys ending in _s, and total_s),
        plus num_tokens, kv_bytes_read and host_seconds (the engine's host time,
        of which overhead_s holds what the GPU does not hide); for plots and debugging."""
        terms = self._terms(slices, num_sampled)
        out = dict(zip(("gemm_s", "experts_s", "attention_s", "elementwise_s", "lm_head_s",
                        "allreduce_s", "pp_transfer_s", "overhead_s"), terms))
        q = [q for q, _ in _pairs(slices)]
        out["host_seconds"] = self._engine.host_s(len(q), float(sum(q)))
        out["total_s"] = sum(terms)
        out["num_tokens"] = float(sum(q for q, _ in _pairs(slices)))
        out["kv_bytes_read"] = float(self.kv_bytes_read(slices))
        return out

    def kv_bytes_read(self, slices: Slices) -> int:
        """KV bytes attention reads this iteration over the whole model: every
        slice's context (cached prefix plus its new tokens), all layers."""
        return self.model.kv_bytes_per_token * sum(int(c) for _, c in _pairs(slices))

    def _terms(self, slices: Slices, num_sampled: int | None) -> tuple[float, ...]:
        if isinstance(slices, (list, tuple)) and 0 < len(slices) < _SMALL_BATCH:
            m = float(_check_pairs(slices))
            attention = self._attention.seconds_pairs(slices)
        else:
            q, ctx = _arrays(slices)
            m = float(q.sum())
            attention = self._attention.seconds(q, ctx)
        sampled = len(slices) if num_sampled is None else num_sampled
        return self._with_counted(attention, m, sampled, len(slices))

    def _with_counted(self, attention: float, m: float, sampled: int, num_slices: int) -> tuple[float, ...]:
        """The terms of an iteration whose attention takes `attention` seconds."""
        return _terms_of(self._counted_for(m, sampled, num_slices), attention, self._scale)

    def _counted_for(self, m: float, sampled: int, num_slices: int) -> tuple:
        key = (m, sampled, num_slices)
        counted = self._counted.get(key)
        if counted is None:
            counted = self._counted[key] = self._counted_terms(*key)
        return counted

    def _counted_terms(self, m: float, sampled: int, num_slices: int) -> tuple:
        """The terms set by the token and slice counts alone (all but attention),
        scaled, then the host time added to them, the launch bound (None: no
        eager launches) and the host time overlapped with them (None: none).
        _terms keeps them per (m, sampled, num_slices): a run has ~10^6
        iterations over a few thousand such counts (this took ~40% of _terms)."""
        engine = self._engine
        graph = engine.graph_size(m, m == num_slices) if engine.graph_sizes else None
        padded = m if graph is None else float(graph)      # a graph replays its captured size
        terms = (self._gemms_s(padded), self._experts_s(padded), self._elementwise_s(padded),
                 self._lm_head_s(sampled) if sampled else 0.0, self._allreduce_s(padded), self._pp_s(m))
        if self._scale != 1.0:
            terms = tuple(t * self._scale for t in terms)
        host = engine.host_s(num_slices, m)
        bound = engine.launch_bound(m, m == num_slices) if engine.launches_s else None
        if engine.host_overlap:
            return terms + (0.0, bound, host)
        return terms + (host, bound, None)

    def _allreduce_s(self, m: float) -> float:
        """Two all-reduces of the hidden states per layer (after attention, after the MLP)."""
        if self.parallel.tp == 1:
            return 0.0
        hidden = m * self.shapes.hidden_bytes_per_token
        if self.engine.tp_collective == "custom_allreduce":
            one = custom_allreduce_s(hidden, self.parallel.tp, self.engine.allreduce_latency_us,
                                     self._tp_bytes_per_s)
        else:
            one = (self._allreduce_table.seconds(hidden) if self._allreduce_table
                   else self._tp_link.allreduce_time_s(hidden, self.parallel.tp))
        return 2 * self.shapes.num_layers * one

    def _pp_s(self, m: float) -> float:
        if not self._pp_link:
            return 0.0
        return (self.parallel.pp - 1) * self._pp_link.transfer_time_s(m * self.shapes.hidden_bytes_per_token)

    def _experts_s(self, m: float) -> float:
        e = self.shapes.experts
        if e is None:
            return 0.0
        touched = expected_experts_touched(e.num_experts, e.top_k, m)
        if self._tables:
            return self._tables.experts_s(m, touched)
        # one grouped GEMM over the touched experts, m·top_k routed rows; the
        # GEMM ramp is paid per expert
        flops = 2.0 * e.expert_params * (m * e.top_k + self.hardware.gemm_ramp_tokens * touched)
        nbytes = (touched * e.expert_params * self.shapes.weight_dtype_bytes
                  + m * e.top_k * e.act_elems_per_routed_token * self.shapes.dtype_bytes)
        return e.layers * max(flops * self._layer_s_per_flop, nbytes * self._s_per_byte)

    # -- memory ---------------------------------------------------------------

    def kv_capacity_tokens(self, memory_fraction: float = 0.9) -> int:
        """Tokens of KV one GPU holds after the weights, using `memory_fraction`
        of its memory (activations ignored)."""
        from testbed.sim.defaults import gpu_memory
        weights, kv_per_token = gpu_memory(self.model, self.shapes, self.parallel.pp)
        free = self.hardware.memory_gib * 2**30 * memory_fraction - weights
        if free <= 0:
            raise ValueError(
                f"hardware.memory_gib: {self.model.name} needs {weights / 2**30:.1f} GiB of weights per GPU at "
                f"tp={self.parallel.tp} pp={self.parallel.pp}, more than {memory_fraction:.0%} of "
                f"{self.hardware.name}'s {self.hardware.memory_gib} GiB; raise parallel.tp or parallel.pp, or pick "
                "bigger hardware")
        return int(free // kv_per_token)


def _terms_of(counted: tuple, attention: float, scale: float) -> tuple[float, ...]:
    """An iteration's terms from its _counted_terms and its attention seconds."""
    gemm, experts, elementwise, lm_head, allreduce, pp, overhead, launch_bound, overlapped = counted
    if scale != 1.0:
        attention *= scale
    terms = (gemm, experts, attention, elementwise, lm_head, allreduce, pp)
    if launch_bound is not None or overlapped is not None:
        overhead = _engine_s(terms, overhead, launch_bound, overlapped)
    return terms + (overhead,)


def _engine_s(terms: tuple, overhead: float, launch_bound: float | None, overlapped: float | None) -> float:
    """The engine's seconds beyond the kernels' `terms`: eager launches bound
    the kernels' time from below, and host time run beside the GPU shows only
    where it outlasts it (engine_overhead.py)."""
    kernels = sum(terms)
    if launch_bound is not None:
        overhead += max(0.0, launch_bound - kernels)
    if overlapped is not None:
        overhead += max(0.0, overlapped - kernels - overhead)
    return overhead


def custom_allreduce_s(nbytes: float, tp: int, latency_us: float, link_bytes_per_s: float) -> float:
    """One all-reduce inside a CUDA graph (vLLM's custom all-reduce over
    NVLink): a fixed cost per call (the barrier and launch inside the graph,
    engine.allreduce_latency_us) plus each GPU's 2(tp-1)/tp share of the
    bytes at the link's bandwidth."""
    return latency_us * 1e-6 + 2.0 * (tp - 1) / tp * nbytes / link_bytes_per_s


def _remembered(curve: Curve) -> Curve:
    """`curve` with its values kept per m: a run prices ~10^5 iterations over
    far fewer distinct token counts (a few hundred under a token budget)."""
    seconds: dict[float, float] = {}

    def remembered(m: float) -> float:
        s = seconds.get(m)
        if s is None:
            s = seconds[m] = curve(m)
        return s
    return remembered


def _check_pairs(slices: Sequence[tuple[int, int]]) -> int:
    """Σ new tokens of a short batch, each slice checked as _arrays checks them."""
    m = 0
    for q, ctx in slices:
        if q < 1 or ctx < q:
            raise ValueError("slices: each (num_new_tokens, context_len) needs num_new_tokens >= 1 and "
                             "context_len >= num_new_tokens (the context includes the new tokens)")
        m += q
    return m


def _pairs(slices: Slices):
    return slices.tolist() if isinstance(slices, np.ndarray) else slices


def _arrays(slices: Slices) -> tuple[np.ndarray, np.ndarray]:
    """[num_slices] float64 query lengths and contexts, checked."""
    if isinstance(slices, np.ndarray):
        if slices.ndim != 2 or slices.shape[1] != 2:
            raise ValueError(f"slices: expected shape [num_slices, 2], got {slices.shape}")
        q, ctx = slices[:, 0].astype(np.float64), slices[:, 1].astype(np.float64)
    else:
        if not slices:
            raise ValueError("slices: an iteration needs at least one (num_new_tokens, context_len) slice")
        if len(slices) < _SMALL_BATCH:    # one conversion is cheaper for few slices, two columns for many
            q, ctx = np.array(slices, dtype=np.float64).reshape(-1, 2).T
        else:
            qs, cs = zip(*slices)
            q, ctx = np.array(qs, dtype=np.float64), np.array(cs, dtype=np.float64)
    if len(q) == 0:
        raise ValueError("slices: an iteration needs at least one (num_new_tokens, context_len) slice")
    if q.min() < 1 or (ctx - q).min() < 0:
        raise ValueError("slices: each (num_new_tokens, context_len) needs num_new_tokens >= 1 and "
                         "context_len >= num_new_tokens (the context includes the new tokens)")
    return q, ctx
