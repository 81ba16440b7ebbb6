"""Condense Vidur's public operator profiles (microsoft/vidur,
data/profiling/ at the commit testbed/sim/vidur_tables/SOURCE names, MIT licence) into the small tables the GPU presets read at
run time (testbed/sim/vidur_tables/): per GPU, one CSV per model with the
median time of every op by num_tokens and TP degree, an index of the models'
geometry, and per topology the median all-reduce time by message size and
world size. Only the median columns are kept; rows are otherwise unchanged.

    python -m testbed.analysis.condense_vidur_tables [--src ../shared/data/vidur-profiles]
"""
from __future__ import annotations

import argparse
import csv
import shutil
from pathlib import Path

OPS = ("emb", "input_layernorm", "attn_pre_proj", "attn_rope", "attn_post_proj", "post_attention_layernorm",
       "mlp_up_proj", "mlp_act", "mlp_down_proj", "add")
GEOMETRY = ("n_head", "n_kv_head", "n_embd", "n_expanded_embd", "vocab_size", "use_gated_mlp")
# The norm kernel of each profiled model (its HF config; Vidur's geometry does not say):
# RMSNorm unless listed. The elementwise pricing keys norms by kernel kind.
NORMS = {"microsoft/phi-2": "layer_norm"}
DEST = Path(__file__).resolve().parents[2] / "testbed" / "sim" / "vidur_tables"


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[3] / "shared/data/vidur-profiles")
    args = p.parse_args()
    condense_compute(args.src, DEST)
    condense_network(args.src, DEST)
    shutil.copy(args.src / "LICENSE", DEST / "LICENSE")


if __name__ == "__main__":
    main()
