"""Bad configuration fails at start-up with one clear message that names the
field (and says what would be right), in the library and on the command line."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from testbed.block_manager import BlockManager
from testbed.config import RunConfig, RuntimeConfig, SLOConfig, validate
from testbed.kv_transfer.config import TransferConfig
from testbed.kv_transfer.store_config import KVStoreConfig
from testbed.model.config import ModelConfig, load_model_preset
from testbed.model.loader import load_model
from testbed.model_executor import ModelExecutor
from testbed.schedulers import SchedulerConfig, make_scheduler
from testbed.sim.config import ParallelConfig, load_hardware_preset

REPO = Path(__file__).resolve().parents[1]


def one_line_error(excinfo, *fragments: str) -> None:
    msg = str(excinfo.value)
    assert "\n" not in msg, msg
    for f in fragments:
        assert f in msg, f"{f!r} not in {msg!r}"


# ---- library -------------------------------------------------------------------

def test_heads_not_divisible_by_kv_heads():
    with pytest.raises(ValueError) as e:
        ModelConfig(num_heads=8, num_kv_heads=3)
    one_line_error(e, "model.num_kv_heads", "must divide num_heads=8")


def test_hidden_not_divisible_by_heads_without_head_dim():
    with pytest.raises(ValueError) as e:
        ModelConfig(hidden_size=100, num_heads=8, num_kv_heads=2)
    one_line_error(e, "model.head_dim", "set head_dim explicitly")
    assert ModelConfig(hidden_size=100, num_heads=8, num_kv_heads=2, head_dim=16).resolved_head_dim == 16


def test_unknown_model_dtype():
    with pytest.raises(ValueError) as e:
        ModelConfig(dtype="float64")
    one_line_error(e, "model.dtype", "float64", "bfloat16")


@pytest.mark.parametrize("block_size", [0, -16])
def test_block_size_below_one(block_size):
    with pytest.raises(ValueError) as e:
        BlockManager(16, block_size)
    one_line_error(e, "block_size", f"got {block_size}")


def test_no_kv_blocks():
    with pytest.raises(ValueError) as e:
        BlockManager(0, 16)
    one_line_error(e, "num_kv_blocks", "got 0")


def test_unknown_model_preset():
    with pytest.raises(ValueError) as e:
        load_model_preset("llama-nope")
    one_line_error(e, "model='llama-nope'", "tiny", "mid")


def test_preset_override_is_validated():
    with pytest.raises(ValueError) as e:
        load_model_preset("tiny", num_kv_heads=3)
    one_line_error(e, "model.num_kv_heads")


def test_missing_checkpoint_dir(tmp_path):
    missing = tmp_path / "no-such-checkpoint"
    for build in (lambda: load_model(ModelConfig(path=str(missing))),
                  lambda: ModelExecutor(ModelConfig(path=str(missing)), 8, 16, lambda rid: [])):
        with pytest.raises(ValueError) as e:
            build()
        one_line_error(e, "model.path", str(missing), "does not exist")


def test_runtime_refuses_cost_model_only_architectures():
    with pytest.raises(ValueError) as e:
        ModelExecutor(load_model_preset("deepseek-v2-lite", num_layers=1), 8, 16, lambda rid: [])
    one_line_error(e, "attention=mla", "runtime=sim")


@pytest.mark.parametrize("field,value,fragments", [
    ("scheduler", "nope", ["scheduler='nope'", "sarathi"]),
    ("token_budget", 0, ["token_budget", "got 0"]),
    ("attention_backend", "cuda_magic", ["attention_backend='cuda_magic'", "torch"]),
    ("mode", "split", ["mode='split'", "colocated"]),
    ("top_p", 0.0, ["top_p", "(0, 1]"]),
])
def test_run_config_validation(field, value, fragments):
    with pytest.raises(ValueError) as e:
        validate(RunConfig(**{field: value}))
    one_line_error(e, *fragments)


@pytest.mark.parametrize("make,fragments", [
    (lambda: RunConfig(temperature=-1.0), ["temperature", "got -1.0"]),
    (lambda: RunConfig(device="gpu0"), ["device: 'gpu0'", "cpu or cuda"]),
    (lambda: RunConfig(device="cuda"), ["device: 'cuda'", "no CUDA GPU", "device=cpu"]),
    (lambda: RunConfig(slo=SLOConfig(tpot_ms=0.0)), ["slo.tpot_ms", "> 0"]),
    (lambda: RunConfig(parallel=ParallelConfig(intra_node="nvlnk")), ["parallel.intra_node: 'nvlnk'", "nvlink"]),
    (lambda: RunConfig(parallel=ParallelConfig(pp_link="rdma-4")), ["parallel.pp_link: 'rdma-4'", "rdma-400"]),
    (lambda: RunConfig(model=ModelConfig(rope_theta=-1.0)), ["model.rope_theta", "> 0"]),
    (lambda: RunConfig(model=ModelConfig(head_dim=-8)), ["model.head_dim", ">= 0"]),
    (lambda: RunConfig(hardware=load_hardware_preset("h100-sxm", attention_kernel="tritn")),
     ["hardware.attention_kernel: 'tritn'", "triton"]),
    (lambda: RunConfig(hardware=load_hardware_preset("h100-sxm", allreduce_table="dgx")),
     ["hardware.allreduce_table: 'dgx'", "h100_dgx"]),
    # timeouts reach zmq as 32-bit milliseconds: a longer one overflowed inside a worker (a crash
    # mid-run, or a start-up that hung for 120 s)
    (lambda: RunConfig(runtime=RuntimeConfig(frontend_timeout_s=1e30)), ["runtime.frontend_timeout_s", "at most"]),
    (lambda: RunConfig(transfer=TransferConfig(timeout_s=1e30)), ["transfer.timeout_s", "at most"]),
    (lambda: RunConfig(kvstore=KVStoreConfig(timeout_s=1e30)), ["kvstore.timeout_s", "at most"]),
    # read by every worker after start-up: now by the frontend before it starts any
    (lambda: RunConfig(model=ModelConfig(path="/nonexistent/ckpt")), ["model.path", "/nonexistent/ckpt", "does not exist"]),
])
def test_run_config_fields_checked_at_start_up(make, fragments):
    """Fields a run would otherwise ignore or crash on deep inside a worker."""
    if "cuda" in fragments[0] and __import__("torch").cuda.is_available():
        pytest.skip("this machine has a CUDA GPU: device=cuda is valid here")
    with pytest.raises(ValueError) as e:
        validate(make())
    one_line_error(e, *fragments)


def test_default_run_config_is_valid():
    validate(RunConfig())


def test_scheduler_config_errors():
    with pytest.raises(ValueError) as e:
        make_scheduler("nope", SchedulerConfig(16, 8, 64), BlockManager(8, 16))
    one_line_error(e, "scheduler='nope'", "orca", "request_level", "sarathi", "vllm_v0")
    with pytest.raises(ValueError) as e:
        make_scheduler("sarathi", SchedulerConfig(0, 8, 64), BlockManager(8, 16))
    one_line_error(e, "token_budget", "got 0")


# ---- command line ----------------------------------------------------------------

CLI_CASES = {
    "scheduler": (["scheduler=nope"], "scheduler='nope'"),
    "token_budget": (["token_budget=0"], "token_budget"),
    "rate": (["workload.rate=0"], "workload.rate"),
    "trace": (["workload.trace_path=/nonexistent", "workload.trace_format=azure", "workload.arrival=trace"],
              "workload.trace_path"),
    "model_preset": (["model=nope"], "model='nope'"),
    # num_kv_blocks=auto on a GPU preset divides by the block size: checked before that
    "block_size_gpu": (["runtime=sim", "hardware=h100-sxm", "model=llama3-8b", "block_size=0"], "block_size"),
    # Ray itself would retry an address where nothing listens for minutes
    "ray_address_refused": (["launcher=ray", "mode=disagg", "ray.address=127.0.0.1:1"], "ray.address: nothing answers"),
    "ray_address_malformed": (["launcher=ray", "mode=disagg", "ray.address=zzz"], "ray.address: 'zzz' is not HOST:PORT"),
    # the local cluster has no custom resources: placement used to wait ray.start_timeout_s (120 s) and fail
    "ray_resources_local": (["launcher=ray", "mode=disagg", "+ray.resources.prefill=node_a"], "ray.resources.prefill"),
    "ray_start_timeout": (["launcher=ray", "mode=disagg", "ray.start_timeout_s=1e30"], "ray.start_timeout_s"),
    # a file where the KV store's disk tier wants a directory: before, its process failed at start-up
    "kvstore_disk_path": (["mode=kvstore", "kvstore.disk_path=README.md", "kvstore.disk_capacity_bytes=1000000"],
                          "kvstore.disk_path: 'README.md' is a file"),
    # refused inside the store's own process (a directory under a file): its traceback was printed as well
    "kvstore_disk_tier_unmakeable": (["mode=kvstore", "kvstore.disk_path=README.md/tier",
                                      "kvstore.disk_capacity_bytes=1000000"],
                                     "the KV store failed to start: ValueError: kvstore.disk_path"),
}


@pytest.mark.parametrize("case", sorted(CLI_CASES))
def test_cli_bad_config_is_one_line_exit_2(case, tmp_path):
    overrides, field = CLI_CASES[case]
    testbed = Path(sys.executable).with_name("testbed")
    env = dict(os.environ, OMP_NUM_THREADS="1", WANDB_MODE="disabled")
    proc = subprocess.run([str(testbed), "run", *overrides, "wandb.mode=disabled", f"hydra.run.dir={tmp_path}"],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2, proc.stderr
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("error: ") and field in lines[0], lines[0]
    assert not (tmp_path / "summary.json").exists()


@pytest.mark.parametrize("variant", [{"norm": "layer_norm"}, {"parallel_block": True}, {"gated_mlp": False}])
def test_the_real_engine_refuses_an_architecture_it_does_not_build(variant):
    from testbed.model.llama import LlamaModel
    (field, value), = variant.items()
    with pytest.raises(ValueError, match=rf"{field}={value}\b.* only run with runtime=sim"):
        LlamaModel(ModelConfig(**variant))
