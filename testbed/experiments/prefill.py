"""The prefill studies (experiments/README.md): what chunking a prompt costs,
measured on the real executor and priced by the cost model on the same shapes.

- `chunk_overhead` (Sarathi-Serve Figure 9a): a prompt of L tokens prefilled
  alone, whole (one iteration) against chunks of C (ceil(L/C) iterations, each
  re-reading the KV before it): chunk_overhead.csv, overhead = chunked / whole.
- `hybrid_batch`: one iteration's time for decode-only, decode + a whole
  prefill and decode + one prefill chunk batches: hybrid_batch.csv. A decode's
  TBT is the time of the iteration it rides in, so this is what a prefill
  does to the running decodes.

Real rows build `Batch`es directly (requests placed at any point of their
life, blocks allocated, KV contents irrelevant to timing) and time
`ModelExecutor.execute`: the forward pass, no scheduler or process around it.
Sim rows ask `CostModel.iteration_time_s` about the same slices.

Timings are the executing thread's CPU time when torch runs on one thread
(torch_threads=1, the default: then every op runs on the calling thread), so
the time this process waits for one of the machine's two shared cores is not
counted; the wall clock otherwise. Each is the least of `experiment.repeats`
runs: other processes only ever add time."""
from __future__ import annotations

import csv
import time
from pathlib import Path

import torch

from testbed.experiments import save_figure
from testbed.batch import Batch, ScheduledSlice
from testbed.config import RunConfig
from testbed.model.config import load_model_preset
from testbed.request import Request
from testbed.sim.config import load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.crossover import chunked_prefill_s

CHUNK_COLUMNS = ["source", "model", "hardware", "prompt_len", "chunk_size", "whole_ms", "chunked_ms", "overhead"]
HYBRID_COLUMNS = ["source", "model", "hardware", "batch", "num_decodes", "decode_context_len", "prompt_len",
                  "chunk_size", "num_prefill_tokens", "iteration_ms", "decode_only_ms", "slowdown",
                  "added_ms_per_prefill_token"]


class RealBench:
    """A model executor over a block manager big enough for the study's shapes.
    `request` makes a request with `computed` tokens already in its (allocated)
    blocks, so a batch can hold a decode at any context or a chunk at any offset."""

    def __init__(self, model: str, max_tokens: int, block_size: int, seed: int, dtype: str = "float32",
                 device: str = "cpu", attention_backend: str = "torch", cuda_graph_sizes: tuple[int, ...] = (),
                 **model_overrides):
        from testbed.block_manager import BlockManager
        from testbed.model_executor import ModelExecutor
        self.model_cfg = load_model_preset(model, dtype=dtype, **model_overrides)
        num_blocks = -(-max_tokens // block_size) + 1
        self.bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        self.executor = ModelExecutor(self.model_cfg, num_blocks, block_size, self.bm.block_table,
                                      attention_backend, device, cuda_graph_sizes)
        self.gen = torch.Generator().manual_seed(seed)
        self._next_id = 0
        self.cpu_clock = device == "cpu" and torch.get_num_threads() == 1

    def _seconds(self, batch: Batch) -> float:
        if not self.cpu_clock:
            return self.executor.execute(batch).duration_s
        t0 = time.thread_time()
        self.executor.execute(batch)
        return time.thread_time() - t0

    def request(self, prompt_len: int, computed: int, num_outputs: int = 0) -> Request:
        tokens = torch.randint(0, self.model_cfg.vocab_size, (prompt_len + num_outputs,), generator=self.gen).tolist()
        self._next_id += 1
        req = Request(f"b{self._next_id}", tokens[:prompt_len], max_tokens=num_outputs + 1)
        req.output_token_ids = tokens[prompt_len:]
        req.num_computed_tokens = computed
        if not self.bm.allocate(req, req.num_tokens):
            raise ValueError(f"RealBench: {req.num_tokens} more tokens do not fit in {self.bm.num_blocks} blocks")
        return req

    def decodes(self, n: int, context_len: int) -> list[ScheduledSlice]:
        """n decodes, each computing the last of its context_len tokens."""
        return [ScheduledSlice(self.request(context_len - 1, context_len - 1, 1), 1) for _ in range(n)]

    def batch_s(self, batch: Batch, repeats: int) -> float:
        """The executor's time for `batch`, the least of `repeats` runs (the
        requests do not advance: each run computes the same tokens)."""
        return min(self._seconds(batch) for _ in range(repeats))

    def prefill_s(self, req: Request, chunk: int | None, repeats: int) -> float:
        """`req`'s prompt prefilled alone, the least of `repeats` runs: one
        iteration, or ceil(L/C) iterations of C tokens, each attending over
        the KV the previous ones wrote. Leaves the prompt computed."""
        step = chunk or req.prompt_len
        times = []
        for _ in range(repeats):
            req.num_computed_tokens, total = 0, 0.0
            while req.num_computed_tokens < req.prompt_len:
                n = min(step, req.prompt_len - req.num_computed_tokens)
                total += self._seconds(Batch([ScheduledSlice(req, n)]))
                req.num_computed_tokens += n
            times.append(total)
        return min(times)


def _cpu_cost(model: str) -> CostModel:
    """The cost model of a real-engine model (float32, as it runs here) on the `cpu` profile."""
    return CostModel(load_model_preset(model, dtype="float32"), load_hardware_preset("cpu"))


# -- chunk_overhead --------------------------------------------------------------------------------------
def _overhead_row(source, model, hw, n, c, whole_s, chunked_s) -> dict:
    return {"source": source, "model": model, "hardware": hw, "prompt_len": n, "chunk_size": c,
            "whole_ms": whole_s * 1e3, "chunked_ms": chunked_s * 1e3, "overhead": chunked_s / whole_s}


def _sim_overhead_rows(cost: CostModel, lengths, chunks) -> list[dict]:
    rows = []
    for n in lengths:
        whole = cost.iteration_time_s([(n, n)], num_sampled=1)
        for c in chunks:
            rows.append(_overhead_row("sim", cost.model.name, cost.hardware.name, n, c, whole,
                                      chunked_prefill_s(cost, n, c)))
    return rows


def _real_overhead_rows(cfg: RunConfig, model: str, log) -> list[dict]:
    e = cfg.experiment
    lengths = [n for n in e.real_context_lens if n <= e.real_max_tokens]
    if not lengths:
        return []
    bench = RealBench(model, max(lengths), cfg.block_size, cfg.seed)
    warm = bench.request(min(lengths), 0)
    bench.prefill_s(warm, None, 1)                  # warm-up: allocator, thread pool
    bench.bm.free(warm.request_id)
    rows = []
    for n in lengths:
        req = bench.request(n, 0)
        whole = bench.prefill_s(req, None, e.repeats)
        for c in e.real_chunk_sizes:
            # a prompt within one chunk is not chunked: same computation
            chunked = whole if c >= n else bench.prefill_s(req, c, e.repeats)
            rows.append(_overhead_row("real", model, "this-cpu", n, c, whole, chunked))
        bench.bm.free(req.request_id)
        log(f"  real {model} L={n}: whole {whole * 1e3:.0f} ms, "
            + ", ".join(f"C={r['chunk_size']} x{r['overhead']:.2f}" for r in rows if r["prompt_len"] == n))
    return rows


def _plot_overhead(rows: list[dict], path: Path) -> None:
    """One panel per (model, hardware) of the simulator, lines per chunk size;
    the real engine's points on the panel of the same model's cpu profile."""
    plt = _pyplot()
    panels = list(dict.fromkeys((r["model"], r["hardware"]) for r in rows if r["source"] == "sim"))
    real_models = list(dict.fromkeys(r["model"] for r in rows if r["source"] == "real"))
    panels += [(m, "this-cpu") for m in real_models if (m, "cpu") not in panels]
    fig, axes = _grid(plt, len(panels), 4.6, 4.2)
    chunks = sorted({r["chunk_size"] for r in rows})
    colors = {c: plt.rcParams["axes.prop_cycle"].by_key()["color"][i % 10] for i, c in enumerate(chunks)}
    for ax, (model, hw) in zip(axes, panels):
        for c in chunks:
            sim = sorted((r for r in rows if r["source"] == "sim" and r["model"] == model and r["hardware"] == hw
                          and r["chunk_size"] == c), key=lambda r: r["prompt_len"])
            if sim:
                ax.plot([r["prompt_len"] for r in sim], [r["overhead"] for r in sim], "-", color=colors[c],
                        label=f"C={c} (sim)")
            if hw in ("cpu", "this-cpu"):
                real = sorted((r for r in rows if r["source"] == "real" and r["model"] == model
                               and r["chunk_size"] == c), key=lambda r: r["prompt_len"])
                ax.plot([r["prompt_len"] for r in real], [r["overhead"] for r in real], "o--", color=colors[c],
                        label=f"C={c} (measured)")
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_title(f"{model} on {hw}" + (" + measured" if hw == "cpu" and model in real_models else ""))
        ax.set_xlabel("prompt length (tokens)")
        ax.set_ylabel("chunked / whole prefill time")
        ax.legend(fontsize=7)
    save_figure(fig, path, "Prefill time in chunks of C over one whole prefill (Sarathi-Serve Fig. 9a)")


def run_chunk_overhead(cfg: RunConfig, out: Path, log=print) -> dict:
    e = cfg.experiment
    rows = []
    for model in e.models:
        for hw in e.hardware:
            cost = CostModel(load_model_preset(model), load_hardware_preset(hw), engine=cfg.engine)
            rows += _sim_overhead_rows(cost, e.context_lens, e.chunk_sizes)
    real_lengths = [n for n in e.real_context_lens if n <= e.real_max_tokens]
    for model in e.real_models:
        rows += _sim_overhead_rows(_cpu_cost(model), real_lengths, e.real_chunk_sizes)
    if e.real:
        torch.set_num_threads(cfg.torch_threads)
        for model in e.real_models:
            rows += _real_overhead_rows(cfg, model, log)
    _write_csv(out / "chunk_overhead.csv", CHUNK_COLUMNS, rows)
    _plot_overhead(rows, out / "chunk_overhead.png")
    return {"experiment": "chunk_overhead", "num_points": len(rows), "real_clock": _clock_name(),
            "headline": _overhead_headline(rows),
            "figures": ["chunk_overhead.png"], "rows": rows}


def _overhead_headline(rows: list[dict]) -> list[dict]:
    """The overhead at C=512 (or the smallest chunk) for each source/model/hardware and prompt length."""
    c0 = 512 if any(r["chunk_size"] == 512 for r in rows) else min(r["chunk_size"] for r in rows)
    return [{k: r[k] for k in ("source", "model", "hardware", "prompt_len", "chunk_size", "overhead")}
            for r in rows if r["chunk_size"] == c0]


# -- hybrid_batch --------------------------------------------------------------------------------------
def _hybrid_shapes(num_decodes: int, ctx: int, lengths, chunks) -> list[tuple[str, int, int, list[tuple[int, int]]]]:
    """(kind, prompt_len, chunk_size, prefill slices) per batch; the decodes
    come on top. A chunk is the prompt's last one: the most prefix to re-read."""
    shapes = [("decode_only", 0, 0, [])]
    for n in lengths:
        shapes.append(("decode+whole_prefill", n, n, [(n, n)]))
        shapes += [("decode+chunk", n, c, [(c, n)]) for c in chunks if c < n]
    return shapes


def _hybrid_row(source, model, hw, e, kind, n, c, seconds, decode_only_s) -> dict:
    added = c if kind != "decode_only" else 0
    return {"source": source, "model": model, "hardware": hw, "batch": kind, "num_decodes": e.num_decodes,
            "decode_context_len": e.decode_context_len, "prompt_len": n, "chunk_size": c,
            "num_prefill_tokens": added, "iteration_ms": seconds * 1e3, "decode_only_ms": decode_only_s * 1e3,
            "slowdown": seconds / decode_only_s,
            "added_ms_per_prefill_token": (seconds - decode_only_s) * 1e3 / added if added else 0.0}


def _sim_hybrid_rows(cost: CostModel, e, lengths, chunks) -> list[dict]:
    decodes = [(1, e.decode_context_len)] * e.num_decodes
    base = cost.iteration_time_s(decodes)
    return [_hybrid_row("sim", cost.model.name, cost.hardware.name, e, kind, n, c,
                        cost.iteration_time_s(decodes + pre), base)
            for kind, n, c, pre in _hybrid_shapes(e.num_decodes, e.decode_context_len, lengths, chunks)]


def _real_hybrid_rows(cfg: RunConfig, model: str, lengths, log) -> list[dict]:
    e = cfg.experiment
    need = e.num_decodes * e.decode_context_len + max(lengths, default=0)
    bench = RealBench(model, need, cfg.block_size, cfg.seed)
    decodes = bench.decodes(e.num_decodes, e.decode_context_len)
    bench.batch_s(Batch(list(decodes)), 1)                        # warm-up
    base = bench.batch_s(Batch(list(decodes)), max(e.repeats, 3))
    rows = []
    for kind, n, c, _ in _hybrid_shapes(e.num_decodes, e.decode_context_len, lengths, e.real_chunk_sizes):
        if kind == "decode_only":
            seconds = base
        else:
            prefill = ScheduledSlice(bench.request(n, n - c), c)
            seconds = bench.batch_s(Batch(list(decodes) + [prefill]), e.repeats)
            bench.bm.free(prefill.request.request_id)
        rows.append(_hybrid_row("real", model, "this-cpu", e, kind, n, c, seconds, base))
    log(f"  real {model}: decode-only {base * 1e3:.1f} ms; "
        + ", ".join(f"{r['batch']} L={r['prompt_len']} C={r['chunk_size']} {r['iteration_ms']:.0f} ms"
                    for r in rows[1:]))
    return rows


def _plot_hybrid(rows: list[dict], path: Path) -> None:
    """One panel per (source, model, hardware): a bar per batch kind, grouped
    by prompt length, log scale; the decode-only time as a line."""
    plt = _pyplot()
    panels = list(dict.fromkeys((r["source"], r["model"], r["hardware"]) for r in rows))
    fig, axes = _grid(plt, len(panels), 5.2, 4.4)
    for ax, (source, model, hw) in zip(axes, panels):
        prow = [r for r in rows if (r["source"], r["model"], r["hardware"]) == (source, model, hw)]
        base = prow[0]["decode_only_ms"]
        bars = [r for r in prow if r["batch"] != "decode_only"]
        labels = [f"L={r['prompt_len']}\n" + ("whole" if r["batch"] == "decode+whole_prefill"
                                               else f"C={r['chunk_size']}") for r in bars]
        colors = ["tab:red" if r["batch"] == "decode+whole_prefill" else "tab:blue" for r in bars]
        ax.bar(range(len(bars)), [r["iteration_ms"] for r in bars], color=colors)
        ax.axhline(base, color="tab:green", lw=1.5, label=f"{prow[0]['num_decodes']} decodes alone: {base:.1f} ms")
        ax.set_xticks(range(len(bars)), labels, fontsize=7)
        ax.set_yscale("log")
        ax.set_ylabel("iteration ms (= the decodes' TBT)")
        ax.set_title(f"{model} on {hw} ({'measured' if source == 'real' else 'cost model'})")
        ax.legend(fontsize=7, loc="upper left")
    save_figure(fig, path, "One iteration: decodes alone, with a prompt's last chunk (blue), with a whole prefill (red)")


def run_hybrid_batch(cfg: RunConfig, out: Path, log=print) -> dict:
    e = cfg.experiment
    rows = []
    for model in e.models:
        for hw in e.hardware:
            cost = CostModel(load_model_preset(model), load_hardware_preset(hw), engine=cfg.engine)
            rows += _sim_hybrid_rows(cost, e, e.context_lens, e.chunk_sizes)
    real_lengths = [n for n in e.real_context_lens if n <= e.real_max_tokens]
    for model in e.real_models:
        rows += _sim_hybrid_rows(_cpu_cost(model), e, real_lengths, e.real_chunk_sizes)
    if e.real:
        torch.set_num_threads(cfg.torch_threads)
        for model in e.real_models:
            rows += _real_hybrid_rows(cfg, model, real_lengths, log)
    _write_csv(out / "hybrid_batch.csv", HYBRID_COLUMNS, rows)
    _plot_hybrid(rows, out / "hybrid_batch.png")
    return {"experiment": "hybrid_batch", "num_points": len(rows), "real_clock": _clock_name(),
            "figures": ["hybrid_batch.png"], "rows": rows}


# -- shared -------------------------------------------------------------------------------------------
def _write_csv(path: Path, columns: list[str], rows: list[dict]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns)
        w.writeheader()
        w.writerows(rows)


def _clock_name() -> str:
    return "thread CPU time" if torch.get_num_threads() == 1 else "wall clock"


def _grid(plt, n: int, width: float, height: float, max_cols: int = 3):
    """A figure of n panels, at most max_cols a row; returns (figure, the n axes), the spare ones hidden."""
    cols = min(n, max_cols)
    rows = -(-n // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(width * cols, height * rows), squeeze=False)
    flat = [ax for row in axes for ax in row]
    for ax in flat[n:]:
        ax.set_visible(False)
    return fig, flat[:n]


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt
