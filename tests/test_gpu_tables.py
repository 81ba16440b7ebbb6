"""The GPU presets' measured operator tables: they ship in the repository, the
shape model predicts a model it never saw (leave one model out), unprofiled
architectures get prices, all-reduces follow their table, and the roofline
ratio carries a table to another chip. Figures: experiments/benchmarks/bench_gpu_presets.py."""
import math
from pathlib import Path

import numpy as np
import pytest

from testbed.model.config import load_model_preset
from testbed.sim.collectives import AllReduceTable
from testbed.sim.config import ParallelConfig, load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.operator_table import (GEMM_OPS, TABLES_DIR, elementwise_samples, gemm_samples, load_allreduce_table,
                                        load_compute_table)
from testbed.sim.table_pricing import TableElementwise, TableGemms, local_loglinear

REPO = Path(__file__).resolve().parents[1]


def test_tables_ship_inside_the_repository_with_their_licence():
    assert TABLES_DIR.resolve().is_relative_to(REPO)
    assert "MIT License" in (TABLES_DIR / "LICENSE").read_text()
    assert "7d47513" in (TABLES_DIR / "README.md").read_text()
    assert sum(p.stat().st_size for p in TABLES_DIR.rglob("*") if p.is_file()) < 3 * 2**20
    assert len(load_compute_table("h100")) == 6 and len(load_compute_table("a100")) == 8


def _held_out(gpu: str, name: str):
    models = load_compute_table(gpu)
    held = next(m for m in models if m.name == name)
    train = [m for m in models if m.name != name]
    return held, TableGemms(gemm_samples(train)), TableElementwise(elementwise_samples(train))


CASES = [(gpu, m.name) for gpu in ("h100", "a100") for m in load_compute_table(gpu)]


@pytest.mark.parametrize("gpu, name", CASES)
def test_leave_one_model_out_gemms_and_layer(gpu, name):
    """Tables without a model predict its GEMMs: the median |error| over its
    rows within 15% at m >= 64 and 25% below for every GEMM op; the layer
    (every op but the embedding) within 10% at the median and for most rows.
    Single rows do miss by 20-45% where cuBLAS switches tiles at an m the
    neighbouring shapes do not share (experiments/README.md)."""
    held, gemms, elementwise = _held_out(gpu, name)
    errors = {op: ([], []) for op in GEMM_OPS}
    layer = []
    for m, tp, ops in held.rows:
        predicted = measured = 0.0
        for op, t in ops.items():
            if op in GEMM_OPS:
                p = gemms.seconds(m, *held.gemm_shape(op, tp))
                errors[op][m >= 64].append(abs(p / t - 1))
            elif op != "emb":
                p = elementwise.seconds(op, m, held.elementwise_width(op, tp), held.elementwise_kernel(op))
            else:
                continue
            predicted += p
            measured += t
        layer.append(abs(predicted / measured - 1))
    for op, (small, big) in errors.items():
        assert np.median(big) <= 0.15, op
        assert np.median(small) <= 0.25, op
    assert np.median(layer) <= 0.10
    assert np.mean(np.array(layer) <= 0.10) >= 0.85


def test_a_profiled_shape_is_priced_close_to_its_own_rows():
    models = load_compute_table("h100")
    gemms = TableGemms(gemm_samples(models))
    llama = next(m for m in models if m.name.endswith("Llama-2-70b-hf"))
    n, k = llama.gemm_shape("mlp_up_proj", 8)
    for m, tp, ops in llama.rows:
        if tp == 8 and m in (1, 64, 1024, 4096):
            assert gemms.seconds(m, n, k) == pytest.approx(ops["mlp_up_proj"], rel=0.15)


def test_local_loglinear_reproduces_a_power_law_exactly():
    rng = np.random.default_rng(0)
    x = rng.uniform(5, 10, size=(40, 2))
    y = (0.3 + 0.8 * x[:, 0] + 1.1 * x[:, 1])[:, None]
    q = np.array([7.0, 8.0])
    assert local_loglinear(x, y, q, prior=0.0)[0] == pytest.approx(0.3 + 0.8 * 7 + 1.1 * 8, rel=1e-9)


@pytest.mark.parametrize("model, tp", [("yi-34b", 2), ("mixtral-8x7b", 2), ("falcon-180b", 8), ("deepseek-v2-lite", 1),
                                       ("llama3-8b", 1)])
def test_unprofiled_models_get_prices_that_grow_with_the_batch(model, tp):
    cost = CostModel(load_model_preset(model), load_hardware_preset("h100-sxm"), ParallelConfig(tp=tp))
    decodes = [cost.iteration_time_s([(1, 1024)] * b) for b in (1, 16, 64, 256)]
    prefills = [cost.iteration_time_s([(n, n)]) for n in (2048, 8192, 32768)]
    assert all(math.isfinite(t) and t > 0 for t in decodes + prefills)
    assert decodes == sorted(decodes) and prefills == sorted(prefills)


def test_allreduce_follows_its_table_and_grows_with_size_past_it():
    rows = [r for r in load_allreduce_table("h100_dgx") if r[0] == 8 and r[1] == 8]
    largest = max(size for _, _, size, _ in rows)
    table = AllReduceTable("h100_dgx", 8)
    assert table.seconds(2 * largest) == pytest.approx(2 * table.seconds(largest), rel=1e-12)
    sizes = [2**20, 2**22, 2**24, 2**26]
    assert [table.seconds(s) for s in sizes] == sorted(table.seconds(s) for s in sizes)
    with pytest.raises(ValueError, match="no all-reduce over 8 GPUs"):
        AllReduceTable("h100_pairwise_nvlink", 8)


def test_tp_prices_its_allreduces_from_the_preset_table():
    hw = load_hardware_preset("h100-sxm")
    cost = CostModel(load_model_preset("llama2-70b"), hw, ParallelConfig(tp=8))
    table = AllReduceTable("h100_dgx", 8)
    hidden = 64 * cost.shapes.hidden_bytes_per_token
    assert cost.breakdown([(1, 1024)] * 64)["allreduce_s"] == pytest.approx(
        2 * cost.shapes.num_layers * table.seconds(hidden), rel=1e-12)


def test_h200_memory_bound_gemms_move_with_the_bandwidth():
    """A decode's GEMMs are memory-bound: the H100 table's time, times 3.35/4.8."""
    model = load_model_preset("llama3-8b")
    h100 = CostModel(model, load_hardware_preset("h100-sxm")).breakdown([(1, 1024)])["gemm_s"]
    h200 = CostModel(model, load_hardware_preset("h200")).breakdown([(1, 1024)])["gemm_s"]
    assert h200 == pytest.approx(h100 * 3350 / 4800, rel=1e-9)


def test_every_gpu_preset_names_its_sources():
    for name in ("h100-sxm", "h200", "a100-80gb-sxm", "a100-80gb-pcie"):
        hw = load_hardware_preset(name)
        assert hw.gemm_table and hw.attention_kernel and "vidur@7d47513" in hw.provenance
        assert hw.token_budget_default == 2048 and hw.kv_blocks_default == 0


def test_no_preset_or_table_reads_shared():
    for p in list((REPO / "conf" / "hardware").glob("*.yaml")) + list(TABLES_DIR.rglob("*.csv")):
        assert "../shared" not in p.read_text()
