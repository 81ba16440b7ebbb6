"""Reader of the measured operator tables the GPU presets are priced from:
a profile dataset in Vidur's layout (the preset's `operator_tables`, e.g.
vidur-profiles: Vidur's public A100/H100 profiles), condensed on first use by
vidur_condense.py into the data directory (`tables_dir`).

A compute table holds, per profiled model, the median time of every op of one
transformer layer by num_tokens and TP degree. This module turns those rows
into shape-keyed samples, which is all the pricing models (gemm_model.py)
see: a GEMM sample is (m, n, k, seconds) on one GPU, an elementwise sample
(m, width, seconds) with width the elements of one token's row.
Model names only label samples, so that a model can be left out of a fit.

A network table holds the median all-reduce time by message size and world
size on one topology (collectives.py reads it)."""
from __future__ import annotations

import csv
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

from testbed.data.derived import code_version, derived_dir
from testbed.sim import vidur_condense
from testbed.sim.elementwise_kernels import elementwise_kernel

CONDENSED = "condensed-tables"

GEMM_OPS = ("attn_pre_proj", "attn_post_proj", "mlp_up_proj", "mlp_down_proj")
# per layer, except emb (once per iteration)
ELEMENTWISE_OPS = ("input_layernorm", "post_attention_layernorm", "attn_rope", "mlp_act", "add", "emb")


@dataclass(frozen=True)
class ProfiledModel:
    """One profiled model's geometry and its rows: (num_tokens, tp, {op: seconds})."""
    name: str
    n_head: int
    n_kv_head: int
    n_embd: int
    n_expanded_embd: int
    gated: bool
    norm: str                 # its norm kernel: rms_norm or layer_norm (elementwise_kernels.py)
    rows: tuple[tuple[int, int, dict[str, float]], ...]

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def gemm_shape(self, op: str, tp: int) -> tuple[int, int]:
        """(n, k) of a GEMM op on one of `tp` GPUs (Megatron splits: heads,
        the MLP's intermediate dimension; KV heads replicated below one per GPU)."""
        d, h = self.head_dim, self.n_embd
        heads, kv_heads = self.n_head // tp, max(1, self.n_kv_head // tp)
        inter = self.n_expanded_embd // tp
        return {"attn_pre_proj": ((heads + 2 * kv_heads) * d, h),
                "attn_post_proj": (h, heads * d),
                "mlp_up_proj": ((2 if self.gated else 1) * inter, h),
                "mlp_down_proj": (h, inter)}[op]

    def elementwise_width(self, op: str, tp: int) -> int:
        """Elements one token moves through an elementwise op on one GPU."""
        heads, kv_heads = self.n_head // tp, max(1, self.n_kv_head // tp)
        inter = self.n_expanded_embd // tp
        return {"input_layernorm": self.n_embd, "post_attention_layernorm": self.n_embd, "add": self.n_embd,
                "emb": self.n_embd, "attn_rope": (heads + kv_heads) * self.head_dim,
                "mlp_act": ((2 if self.gated else 1) + 1) * inter}[op]

    @property
    def parallel_block(self) -> bool:
        """Attention and MLP side by side on one norm (phi-2): no post-attention norm rows."""
        return not any("post_attention_layernorm" in ops for _, _, ops in self.rows)

    def elementwise_kernel(self, op: str) -> str:
        return elementwise_kernel(op, self.norm, self.gated, self.parallel_block)


# samples are NamedTuples, not frozen dataclasses: a run's start-up makes ~50K
# of them, and a frozen dataclass's __init__ costs ~4x a NamedTuple's
class GemmSample(NamedTuple):
    model: str
    op: str
    tp: int
    m: int
    n: int
    k: int
    seconds: float


class ElementwiseSample(NamedTuple):
    model: str
    op: str
    kernel: str               # the kernel kind that ran it (elementwise_kernels.py)
    tp: int
    m: int
    width: int                # elements of one token's row
    seconds: float


def tables_dir(dataset: str, needed_by: str) -> Path:
    """The condensed tables of a profile dataset in Vidur's layout, made the
    first time they are asked for and cached in the data directory."""
    version = code_version(Path(vidur_condense.__file__))
    return derived_dir(dataset, CONDENSED, version, vidur_condense.condense, needed_by)


def gpu_table_names(tables: Path) -> list[str]:
    return sorted(p.name for p in (tables / "compute").iterdir() if p.is_dir())


@lru_cache(maxsize=None)
def load_compute_table(tables: Path, gpu: str) -> tuple[ProfiledModel, ...]:
    """Every profiled model of one GPU table ('h100', 'a100') of the condensed `tables`."""
    root = tables / "compute" / gpu
    if not (root / "models.csv").exists():
        raise ValueError(f"hardware.gemm_table: '{gpu}' is not a known operator table; "
                         f"choose one of: {', '.join(gpu_table_names(tables))}")
    models = []
    with (root / "models.csv").open() as f:
        for entry in csv.DictReader(f):
            rows = []
            with (root / entry["file"]).open() as g:
                for r in csv.DictReader(g):
                    ops = {op: float(v) * 1e-3 for op, v in r.items()      # ms -> s
                           if op not in ("num_tokens", "tp") and v != ""}
                    rows.append((int(r["num_tokens"]), int(r["tp"]), ops))
            models.append(ProfiledModel(entry["model"], int(entry["n_head"]), int(entry["n_kv_head"]),
                                        int(entry["n_embd"]), int(entry["n_expanded_embd"]),
                                        entry["use_gated_mlp"] == "True", entry["norm"], tuple(rows)))
    return tuple(models)


def gemm_samples(models: tuple[ProfiledModel, ...] | list[ProfiledModel]) -> list[GemmSample]:
    samples = []
    for pm in models:
        # one shape per (op, tp), not per row: a run's start-up builds ~20K samples
        shapes = {(op, tp): pm.gemm_shape(op, tp) for tp in {tp for _, tp, _ in pm.rows} for op in GEMM_OPS}
        samples += [GemmSample(pm.name, op, tp, m, *shapes[op, tp], ops[op])
                    for m, tp, ops in pm.rows for op in GEMM_OPS if op in ops]
    return samples


def elementwise_samples(models: tuple[ProfiledModel, ...] | list[ProfiledModel]) -> list[ElementwiseSample]:
    samples = []
    for pm in models:
        # the kernel once per op (parallel_block reads every row) and the width once per (op, tp)
        kernels = {op: pm.elementwise_kernel(op) for op in ELEMENTWISE_OPS}
        widths = {(op, tp): pm.elementwise_width(op, tp) for tp in {tp for _, tp, _ in pm.rows}
                  for op in ELEMENTWISE_OPS}
        samples += [ElementwiseSample(pm.name, op, kernels[op], tp, m, widths[op, tp], ops[op])
                    for m, tp, ops in pm.rows for op in ELEMENTWISE_OPS if op in ops]
    return samples


def network_table_names(tables: Path) -> list[str]:
    return sorted(p.stem for p in (tables / "network").glob("*.csv"))


@lru_cache(maxsize=None)
def load_allreduce_table(tables: Path, topology: str) -> tuple[tuple[int, int, int, float], ...]:
    """Rows (num_workers, devices_per_node, size_bytes, seconds) of one topology."""
    path = tables / "network" / f"{topology}.csv"
    if not path.exists():
        raise ValueError(f"hardware.allreduce_table: '{topology}' is not a known topology; "
                         f"choose one of: {', '.join(network_table_names(tables))}")
    with path.open() as f:
        return tuple((int(r["num_workers"]), int(r["devices_per_node"]), int(r["size"]),
                      float(r["median_ms"]) * 1e-3) for r in csv.DictReader(f))
