"""`testbed profile` with an engine preset (testbed/profiling/gpu_profile.py),
rehearsed on the CPU with the tiny model: the two files it writes, their
fields, and that the simulator loads and prices with them. The numbers are
this CPU's and mean nothing; on a GPU `testbed profile --device cuda` writes
the same files (experiments/gpu_check.sh)."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml

from testbed.model.config import load_model_preset
from testbed.profiling.gpu_profile import fit_nonnegative, profile_gpu
from testbed.profiling.profile import profile_main
from testbed.sim.config import load_hardware_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.engine_config import EngineConfig, load_engine_preset
from testbed.sim.layer_shapes import layer_shapes

ENGINE_TERMS = ("overhead_ms", "overhead_per_seq_ms", "overhead_per_token_ms", "kernel_launch_us", "cuda_graphs",
                "cuda_graph_sizes", "host_model", "host_overlap")


def test_fit_nonnegative_recovers_the_coefficients_and_clamps_at_zero():
    features = np.array([[1.0, s, t] for s, t in ((1, 1), (8, 8), (32, 32), (1, 512), (1, 2048), (33, 544))])
    exact = features @ np.array([0.5, 0.02, 0.001])
    np.testing.assert_allclose(fit_nonnegative(features, exact), [0.5, 0.02, 0.001], atol=1e-12)
    # a per-seq term that would come out negative is held at 0, the others refitted
    coef = fit_nonnegative(features, features @ np.array([0.5, -0.01, 0.001]))
    assert coef[1] == 0.0 and (coef >= 0).all()


def test_engine_and_hardware_presets_rehearsed_on_the_cpu(tmp_path):
    torch.set_num_threads(1)
    hw_path, engine_path = tmp_path / "h200-measured.yaml", tmp_path / "engine" / "testbed.yaml"
    hardware, engine = profile_gpu(hw_path, engine_path, "tiny", "cpu", base="h200", quick=True, sizes=[4, 1, 2],
                                   attention_backend="torch")
    written = load_engine_preset(str(engine_path))
    assert written == engine
    assert (written.name, written.cuda_graphs, written.cuda_graph_sizes) == ("testbed", True, [1, 2, 4])
    assert (written.profiled_for, written.host_model, written.host_overlap) == ("h200-measured", "linear", False)
    assert all(getattr(written, f) >= 0 for f in ("kernel_launch_us", "overhead_ms", "overhead_per_seq_ms",
                                                  "overhead_per_token_ms"))
    assert written.kernel_launch_us > 0 and "3 real-engine steps of tiny" in written.provenance["host_model"]
    assert engine_path.read_text().startswith("# This project's engine with CUDA graphs on cpu")

    raw = yaml.safe_load(hw_path.read_text())
    assert not set(ENGINE_TERMS) & set(raw)                  # the engine's terms live in the engine preset
    loaded = load_hardware_preset(str(hw_path))
    assert (loaded.name, loaded.profiled_for, loaded.gemm_table) == ("h200-measured", "h200-measured", "")
    assert (loaded.peak_tflops, loaded.hbm_bw_gbps, loaded.attention_kernel) == (989.4, 4800.0, "triton")
    shapes = layer_shapes(load_model_preset("tiny"))
    assert len(loaded.gemm_profile) == 3 * len({(g.n, g.k) for g in (*shapes.gemms, shapes.lm_head)})
    assert loaded.gemm_profile == hardware.gemm_profile and "stated preset h200" in loaded.provenance

    model = load_model_preset("tiny", dtype="float32")
    # on the hardware it was profiled for, engine=auto finds it only in conf/engine/; named, it prices
    kernels = CostModel(model, loaded, engine=EngineConfig(name="kernels")).iteration_time_s([(1, 100)] * 4)
    with_overhead = CostModel(model, loaded, engine=written).iteration_time_s([(1, 100)] * 4)
    expected = (engine.overhead_ms + 4 * (engine.overhead_per_seq_ms + engine.overhead_per_token_ms)) * 1e-3
    assert with_overhead - kernels == pytest.approx(expected, rel=1e-6, abs=1e-12)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the error is for machines without a GPU")
def test_profile_on_a_missing_gpu_is_one_line(capsys):
    with pytest.raises(SystemExit) as e:
        profile_main(["--device", "cuda"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("testbed profile: error: --device: 'cuda', but torch") and err.endswith("--device cpu")
