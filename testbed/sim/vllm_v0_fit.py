"""vLLM V0's host time per iteration, fitted to Vidur's measured rows
(dataset `vidur-profiles`, cpu_overheads/<host>.csv; engine=vllm-v0).

A row is one model at one decode batch size B and TP degree. Its host time
is the medians of schedule + sampler_e2e + prepare_inputs_e2e +
process_model_outputs, plus for TP > 1 the mean Ray round trip to the TP
workers (V0 drives them over Ray every iteration). The fit, weighted to
relative error, is

    host_ms = a + b·B + [TP > 1]·(c + d·B + e·log2 TP)

Rows whose schedule time per sequence is below 3/4 of the file's median ran
a smaller batch than their label (the scheduler touched fewer sequences;
Qwen-72B at B 112-128 on A100) and are left out.

The fit is computed at first use and cached in the data directory, keyed by
the dataset's checksum and this code's version. Carrying it to H100-class hosts: the terms are Python on
one host core and a Ray round trip on the same software; the A100 rows come
from a DGX-class server, and no H100 host rows are published, so the A100
host's fit is used as is for H100 (stated in the preset's provenance)."""
from __future__ import annotations

import csv
import hashlib
import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

HOST_PARTS = ("schedule", "sampler_e2e", "prepare_inputs_e2e", "process_model_outputs")
DATASET = "vidur-profiles"
DEFAULT_HOST = "a100"
_SMALL_BATCH_SHARE = 0.75


@dataclass(frozen=True)
class HostRow:
    model: str
    batch_size: int
    tp: int
    host_ms: float


@dataclass(frozen=True)
class V0HostFit:
    """host_ms = a + b·B + [TP > 1]·(c + d·B + e·log2 TP)."""
    a: float
    b: float
    c: float
    d: float
    e: float
    source_sha256: str = ""
    num_rows: int = 0

    def base_ms(self, tp: int) -> float:
        return self.a + ((self.c + self.e * math.log2(tp)) if tp > 1 else 0.0)

    def per_seq_ms(self, tp: int) -> float:
        return self.b + (self.d if tp > 1 else 0.0)

    def host_ms(self, batch_size: int, tp: int) -> float:
        return self.base_ms(tp) + self.per_seq_ms(tp) * batch_size


def _features(batch_size: int, tp: int) -> list[float]:
    multi = 1.0 if tp > 1 else 0.0
    return [1.0, batch_size, multi, multi * batch_size, multi * math.log2(tp)]


def read_host_rows(path: Path) -> list[HostRow]:
    """The rows of one cpu_overheads CSV that ran at their labelled batch size."""
    rows, per_seq = [], []
    with open(path, newline="") as f:
        for line, r in enumerate(csv.DictReader(f), start=2):
            try:
                tp, batch = int(r["tensor_parallel_degree"]), int(r["batch_size"])
                host = sum(float(r[f"{p}_median"]) for p in HOST_PARTS)
                if tp > 1:
                    host += float(r["ray_comm_time_mean"])
                schedule = float(r["schedule_median"])
            except (KeyError, ValueError) as e:
                raise ValueError(f"{path}:{line}: not a Vidur cpu_overheads row ({e}); "
                                 "reinstall the vidur-profiles dataset") from None
            rows.append(HostRow(r["model_name"], batch, tp, host))
            per_seq.append(schedule / batch)
    if not rows:
        raise ValueError(f"{path}: no rows; reinstall the vidur-profiles dataset")
    typical = float(np.median(per_seq))
    return [row for row, s in zip(rows, per_seq) if s >= _SMALL_BATCH_SHARE * typical]


def fit_rows(rows: list[HostRow], source_sha256: str = "") -> V0HostFit:
    x = np.array([_features(r.batch_size, r.tp) for r in rows])
    y = np.array([r.host_ms for r in rows])
    coef, *_ = np.linalg.lstsq(x / y[:, None], np.ones_like(y), rcond=None)
    return V0HostFit(*(float(c) for c in coef), source_sha256=source_sha256, num_rows=len(rows))


def fitted_host_model(dataset: str = DATASET, host: str = DEFAULT_HOST) -> V0HostFit:
    """The fit to `dataset`'s cpu_overheads/<host>.csv, made once and cached
    in the data directory (testbed.data.derived) until the dataset or this
    code changes."""
    from testbed.data.derived import code_version, derived_dir

    def make(src: Path, dest: Path) -> None:
        path = src / "cpu_overheads" / f"{host}.csv"
        if not path.exists():
            raise ValueError(f"{path}: missing from the {dataset} dataset; reinstall it")
        sha = hashlib.sha256(path.read_bytes()).hexdigest()
        (dest / "fit.json").write_text(json.dumps(asdict(fit_rows(read_host_rows(path), sha))))

    cache = derived_dir(dataset, f"vllm-v0-host-{host}", code_version(Path(__file__)), make,
                        needed_by="engine=vllm-v0 (its host time)")
    return V0HostFit(**json.loads((cache / "fit.json").read_text()))
