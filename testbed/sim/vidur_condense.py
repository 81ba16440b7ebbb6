"""The condensed operator tables the GPU presets are priced from, derived
from the vidur-profiles dataset (Vidur's public profiles, microsoft/vidur,
data/profiling/, MIT licence) on first use and cached in the data directory
(testbed.data.derived, keyed by the dataset's checksum and this file's text).
Per GPU, one CSV per model with the median time of every op by num_tokens
and TP degree, an index of the models' geometry; per topology the median
all-reduce time by message size and world size. Only the median columns are
kept; rows are otherwise unchanged."""
from __future__ import annotations

import csv
from pathlib import Path

OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEOMETRY = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
# The norm kernel of each profiled model (its HF config; Vidur's geometry does not say):
# RMSNorm unless listed. The elementwise pricing keys norms by kernel kind.
NORMS = {"microsoft/phi-2": "layer_norm"}


def _median(row: dict, op: str) -> str:
    """The op's median in ms; empty where the model has no such op (phi-2's
    parallel block has no post-attention norm)."""
    value = row.get(f"time_stats.{op}.median")
    return "" if value is None else f"{float(value):.6g}"


def condense_compute(src: Path, dest: Path) -> None:
    for gpu_dir in sorted((src / "compute").iterdir()):
        index = []
        for path in sorted(gpu_dir.glob("*/*/mlp.csv")):
            model = f"{path.parent.parent.name}/{path.parent.name}"
            with path.open() as f:
                rows = list(csv.DictReader(f))
            out = dest / "compute" / gpu_dir.name / f"{path.parent.name}.csv"
            out.parent.mkdir(parents=True, exist_ok=True)
            with out.open("w", newline="") as f:
                w = csv.writer(f)
                w.writerow(["num_tokens", "tp", *OPS])
                for r in rows:
                    w.writerow([r["num_tokens"], r["num_tensor_parallel_workers"],
                                *(_median(r, op) for op in OPS)])
            index.append([model, out.name, *(rows[0][g] for g in GEOMETRY), NORMS.get(model, "rms_norm")])
        with (dest / "compute" / gpu_dir.name / "models.csv").open("w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["model", "file", *GEOMETRY, "norm"])
            w.writerows(index)


def condense_network(src: Path, dest: Path) -> None:
    for path in sorted((src / "network").glob("*/all_reduce.csv")):
        out = dest / "network" / f"{path.parent.name}.csv"
        out.parent.mkdir(parents=True, exist_ok=True)
        with path.open() as f, out.open("w", newline="") as g:
            w = csv.writer(g)
            w.writerow(["num_workers", "devices_per_node", "size", "median_ms"])
            for r in csv.DictReader(f):
                w.writerow([r["num_workers"], r["devices_per_node"], r["size"],
                            f"{float(r['time_stats.all_reduce.median']):.6g}"])


def condense(src: Path, dest: Path) -> None:
    """Write the condensed tables of the profiles in `src` into `dest`."""
    condense_compute(src, dest)
    condense_network(src, dest)
