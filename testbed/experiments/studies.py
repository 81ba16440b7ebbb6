"""The studies `experiment=NAME` chooses, each by its config class; and the
fields of the single experiment config they replaced, for the one-line error
that names a renamed field's new name (testbed/cli_errors.py)."""
from __future__ import annotations

from testbed.experiments.config import StudyConfig
from testbed.experiments.crossover_config import CrossoverConfig
from testbed.experiments.decision_config import DecisionConfig
from testbed.experiments.prefill_config import ChunkOverheadConfig, HybridBatchConfig
from testbed.experiments.serving_config import CapacityConfig, StallConfig

STUDIES: dict[str, type[StudyConfig]] = {
    cls.name: cls for cls in (CrossoverConfig, CapacityConfig, StallConfig, ChunkOverheadConfig,
                              HybridBatchConfig, DecisionConfig)
}

# old experiment.NAME -> the field it became in the study that reads it
RENAMED = {
    **{f"decision_{f}": f for f in (
        "num_gpus", "tbt_slos_ms", "smoothness", "fluidity_min", "ttft_k", "output_len", "prompt_sigma", "reuse",
        "turns", "colocated", "deployments", "tp", "kv_blocks", "pool_tp", "span_factor", "min_judged",
        "max_requests_per_gpu")},
    **{f"decision_real_{f}": f"real_{f}" for f in (
        "num_gpus", "hardware", "probe_s", "budget_s", "rel_tol", "max_probes")},
    **{f"capacity_{f}": f for f in (
        "workloads", "rate_start", "rel_tol", "max_probes", "span_factor", "min_judged", "max_requests")},
    "real_capacity_policies": "real_policies",
    "real_capacity_workload": "real_workload",
}


def study_config(name: str) -> type[StudyConfig]:
    if name not in STUDIES:
        raise ValueError(f"experiment.name='{name}' is not known; choose one of: {', '.join(STUDIES)}")
    return STUDIES[name]


def renamed(study: type[StudyConfig], key: str) -> str | None:
    """The one-line error for experiment.KEY, a field of the old flat config
    that `study` has under another name (None if KEY is no such field)."""
    from dataclasses import fields
    new = RENAMED.get(key)
    if new is None or new not in {f.name for f in fields(study)}:
        return None
    return (f"experiment.{key} is now experiment.{new} (the {study.name} study's {study.__name__}); "
            f"write experiment.{new}=...")
