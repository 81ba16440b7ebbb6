"""The run config's optional sections: each study's settings are its own
dataclass, present only under `experiment=NAME`; the adaptive scheduler's
settings only where a worker runs it; a field renamed by the split is refused
in one line that names its new name; ModeSettings takes the run's values by
field name."""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import tempfile

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.cli import main
from testbed.config import RunConfig, from_dict, register_configs
from testbed.experiments.crossover_config import CrossoverConfig
from testbed.experiments.decision_config import DecisionConfig
from testbed.experiments.prefill_config import ChunkOverheadConfig, HybridBatchConfig
from testbed.experiments.serving_config import CapacityConfig, StallConfig
from testbed.experiments.studies import RENAMED, STUDIES
from testbed.model.config import CONF_DIR
from testbed.runtime.deployment import mode_settings
from testbed.schedulers.adaptive_config import AdaptiveConfig

PRESETS = sorted(p.stem for p in (CONF_DIR / "experiment").glob("*.yaml"))


def composed(*overrides: str) -> RunConfig:
    register_configs()
    with initialize_config_dir(str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", list(overrides)))


def run_cli(*overrides: str) -> tuple[int, list[str]]:
    """testbed run OVERRIDES --cfg job in this process: (exit status, stderr lines)."""
    err, argv = io.StringIO(), sys.argv[:]
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["run", f"hydra.run.dir={tmp}", *overrides, "--cfg", "job"])
        except SystemExit as e:
            code = e.code
        finally:
            sys.argv = argv
    return code, err.getvalue().strip().splitlines()


def test_a_plain_run_has_neither_an_experiment_nor_adaptive_section():
    cfg = composed()
    # the scheduler left unset is the engine's (conf/config.yaml chooses no scheduler option)
    assert cfg.experiment is None and cfg.adaptive is None and cfg.scheduler == cfg.run_engine().scheduler == "sarathi"


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_is_its_studys_own_dataclass_and_validates(preset):
    cfg = composed(f"experiment={preset}")
    study = {"crossover": CrossoverConfig, "capacity": CapacityConfig, "stall": StallConfig,
             "chunk_overhead": ChunkOverheadConfig, "hybrid_batch": HybridBatchConfig,
             "decision": DecisionConfig}[preset.split("-")[0]]
    assert type(cfg.experiment) is study and cfg.experiment.name == preset.split("-")[0]
    assert cfg.experiment.variant == (preset.split("-")[1] if "-" in preset else "default")
    cfg.experiment.validate()


def test_a_study_s_defaults_are_its_default_preset_and_full_sets_values_over_them():
    assert composed("experiment=decision").experiment == DecisionConfig()
    assert composed("experiment=stall").experiment == StallConfig()
    full = composed("experiment=decision-full").experiment
    assert (full.num_gpus, full.tp, full.tbt_slos_ms, full.rel_tol, full.sweep_by) == (
        [2, 4, 8], {"llama2-70b": 4}, [50, 100], 0.1, "cell")
    capacity = composed("experiment=capacity-full").experiment
    # a -full preset's workload fields merge over the default preset's
    assert capacity.workloads["azure_code"]["workload"] == {"max_requests": 1000, "max_prompt_len": None,
                                                            "max_output_len": None}
    assert (capacity.rel_tol, capacity.max_probes, capacity.max_requests) == (0.05, 12, 300)


def test_adaptive_settings_come_only_with_an_adaptive_worker():
    assert composed("scheduler=adaptive").adaptive == AdaptiveConfig()
    assert composed("scheduler=adaptive", "adaptive.min_budget=128").adaptive.min_budget == 128
    assert from_dict({"scheduler": "adaptive"}).adaptive == AdaptiveConfig()
    assert from_dict({"mode": "disagg", "prefill": {"scheduler": "adaptive"}}).adaptive == AdaptiveConfig()
    assert from_dict({"scheduler": "orca"}).adaptive is None
    sarathi = from_dict({})
    assert dataclasses.replace(sarathi, scheduler="adaptive").adaptive == AdaptiveConfig()
    # the decision-real preset's settings are its adaptive deployment's
    real = composed("experiment=decision-real")
    assert (real.scheduler, real.adaptive.min_budget, real.adaptive.budget_multiple) == ("adaptive", 16, 16)


@pytest.mark.parametrize("old", sorted(RENAMED))
def test_a_renamed_study_field_is_refused_naming_its_new_name(old):
    new = RENAMED[old]
    study = next(name for name, cls in STUDIES.items() if new in {f.name for f in dataclasses.fields(cls)})
    code, lines = run_cli(f"experiment={study}", f"experiment.{old}=1")
    assert code == 2
    assert lines == [f"error: experiment.{old} is now experiment.{new} (the {study} study's "
                     f"{STUDIES[study].__name__}); write experiment.{new}=..."]


def test_a_field_of_an_unchosen_section_is_one_line_naming_the_choice():
    assert run_cli("experiment.models=[tiny]") == (2, [
        "error: experiment.models: a plain run has no experiment section; choose a study with experiment=NAME "
        "(crossover, capacity, stall, chunk_overhead, hybrid_batch, decision), e.g. experiment=decision "
        "experiment.models=[tiny]"])
    assert run_cli("adaptive.min_budget=32") == (2, [
        "error: adaptive.min_budget: the adaptive section comes with the adaptive scheduler; choose it, "
        "e.g. scheduler=adaptive adaptive.min_budget=32"])
    # appended keys are checked against the chosen study's fields
    assert run_cli("experiment=decision", "+experiment.kv_blocks.cpu-2w=8192")[0] == 0
    code, lines = run_cli("experiment=stall", "+experiment.kv_blocks.cpu-2w=8192")
    assert code == 2 and lines[0].startswith("error: experiment.kv_blocks: no such field in experiment (StallConfig)")


def test_a_study_config_of_another_name_is_refused():
    with pytest.raises(ValueError, match=r"experiment.name='stall': these are the settings of DecisionConfig "
                                         r"\(the decision study\)"):
        DecisionConfig(name="stall").validate()
    with pytest.raises(ValueError, match=r"experiment.name='nope' is not known; choose one of: crossover, "):
        from_dict({"experiment": {"name": "nope"}})


def test_mode_settings_take_the_run_s_values_by_field_name():
    cfg = from_dict({"mode": "disagg", "replicas": 3, "prefill_workers": 2, "decode_workers": 5,
                     "router": "least_outstanding", "num_kv_blocks": 77, "block_size": 32,
                     "runtime": {"name": "sim"}})
    s = mode_settings(cfg)
    shared = {f.name for f in dataclasses.fields(s)} & {f.name for f in dataclasses.fields(cfg)}
    assert shared == {"replicas", "prefill_workers", "decode_workers", "router", "prefill_router",
                      "decode_router", "num_kv_blocks", "block_size", "kvstore"}
    assert (s.replicas, s.prefill_workers, s.decode_workers, s.router, s.num_kv_blocks, s.block_size) == \
        (3, 2, 5, "least_outstanding", 77, 32)
    assert s.kvstore is cfg.kvstore and s.slo_ttft_ms == cfg.slo.ttft_ms
