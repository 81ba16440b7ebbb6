"""The studies (testbed/experiments): their policies, the real-engine bench
they time, their tables and figures, sweeps with a failing point, and
`testbed report`'s HTML pages. Small shapes; the simulator where a study
allows it, the tiny model where it needs the real engine."""
from __future__ import annotations

import base64
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from testbed.batch import Batch, ScheduledSlice
from testbed.config import from_dict
from testbed.experiments.config import parse_split
from testbed.experiments.serving_config import StallConfig
from testbed.experiments.prefill import CHUNK_COLUMNS, HYBRID_COLUMNS, RealBench
from testbed.experiments.serving import Policy, policies
from testbed.model.config import load_model_preset
from testbed.report import report_main
from testbed.run import execute
from testbed.sim.config import load_hardware_preset, load_link_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.crossover import chunked_prefill_s

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
REPO = Path(__file__).resolve().parents[1]


def read_csv(path: Path) -> tuple[list[str], list[dict]]:
    with open(path, newline="") as f:
        rows = list(csv.DictReader(f))
    with open(path, newline="") as f:
        header = next(csv.reader(f))
    return header, rows


# -- policies ------------------------------------------------------------------------------------------
def test_policies_compare_at_equal_gpu_count():
    e = StallConfig(schedulers=["vllm_v0", "sarathi"], token_budgets=[512, 2048],
                    disagg_splits=["1P1D", "1P3D", "2P2D"])
    assert policies(e, 2) == [Policy("vllm_v0", "colocated", "vllm_v0", None, replicas=2),
                              Policy("sarathi-512", "colocated", "sarathi", 512, replicas=2),
                              Policy("sarathi-2048", "colocated", "sarathi", 2048, replicas=2),
                              Policy("disagg-1P1D", "disagg", "vllm_v0", prefill_workers=1, decode_workers=1)]
    four = policies(e, 4)
    assert [p.label for p in four] == ["vllm_v0", "sarathi-512", "sarathi-2048", "disagg-1P3D", "disagg-2P2D"]
    assert {p.num_gpus for p in four} == {4}
    # one worker (the stall study): every split
    assert [p.label for p in policies(e)][-3:] == ["disagg-1P1D", "disagg-1P3D", "disagg-2P2D"]


def test_a_policy_applies_to_a_plain_run():
    cfg = from_dict({"token_budget": 128, "wandb": {"mode": "offline"}, "experiment": {"name": "stall"}})
    run = Policy("disagg-2P1D", "disagg", "orca", prefill_workers=2, decode_workers=1).apply(cfg)
    assert (run.mode, run.scheduler, run.token_budget, run.prefill_workers, run.decode_workers) == \
        ("disagg", "orca", 128, 2, 1)
    assert run.experiment is None and run.wandb.mode == "disabled"
    assert cfg.experiment.name == "stall"                    # the experiment's own config is untouched


@pytest.mark.parametrize("split", ["2P", "P1D", "0P1D", "1p1d"])
def test_a_bad_split_names_the_field(split):
    with pytest.raises(ValueError, match=r"experiment.disagg_splits: .* xPyD"):
        parse_split(split)
    with pytest.raises(ValueError, match="experiment.disagg_splits"):
        from_dict({"experiment": {"name": "stall", "disagg_splits": [split]}}).experiment.validate()


# -- the real-engine bench ------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bench():
    torch.set_num_threads(1)
    return RealBench("tiny", 1024, 16, seed=0)


def test_bench_chunked_prefill_writes_the_whole_prefills_kv(bench):
    req = bench.request(200, 0)
    slots = [b * 16 + i for b in bench.bm.block_table(req.request_id) for i in range(16)][:200]

    def kv():
        cache = bench.executor.kv_cache          # [layers, 2, blocks, block_size, kv_heads, head_dim]
        return cache.flatten(2, 3)[:, :, slots].clone()
    bench.prefill_s(req, None, 1)
    whole = kv()
    bench.executor.kv_cache.zero_()
    assert bench.prefill_s(req, 64, 2) > 0       # 4 chunks (64, 64, 64, 8), each over the KV before it
    assert req.num_computed_tokens == 200
    torch.testing.assert_close(kv(), whole, rtol=1e-4, atol=1e-5)
    bench.bm.free(req.request_id)


def test_bench_batches_hold_decodes_and_a_chunk(bench):
    decodes = bench.decodes(3, 64)
    chunk = ScheduledSlice(bench.request(128, 96), 32)
    batch = Batch(decodes + [chunk])
    assert (batch.num_decode_tokens, batch.num_prefill_tokens) == (3, 32)
    assert [s.end for s in batch.slices] == [64, 64, 64, 128] and all(s.samples for s in batch.slices)
    assert bench.batch_s(batch, 2) > 0
    assert [s.request.num_computed_tokens for s in batch.slices] == [63, 63, 63, 96]   # timing moves nothing
    for s in batch.slices:
        bench.bm.free(s.request.request_id)
    assert bench.bm.all_free()


# -- crossover --------------------------------------------------------------------------------------------
def test_crossover_table_has_the_isolated_and_piggyback_taxes_with_an_l_star_for_each(tmp_path):
    from testbed.sim.crossover import piggyback_tax_s
    cfg = from_dict({"wandb": {"mode": "disabled"}, "experiment": {
        "name": "crossover", "models": ["llama3-8b"], "hardware": ["h100-sxm"], "links": ["rdma-400", "tcp-25"],
        "context_lens": [1024, 4096, 16384], "chunk_sizes": [512], "piggyback_decodes": [0, 4],
        "decode_context_len": 64, "real_models": ["tiny"], "real_context_lens": [128, 256],
        "real_chunk_sizes": [64], "real_transports": ["zmq"], "real_link_gbps": [], "repeats": 1}})
    result = execute(cfg, tmp_path)
    header, rows = read_csv(tmp_path / "crossover.csv")
    assert {"reread_ms", "piggyback_b0_ms", "piggyback_b4_ms", "transfer_ms"} <= set(header)
    sim = [r for r in rows if r["source"] == "sim" and r["model"] == "llama3-8b"]
    assert len(sim) == 2 * 3
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    for r in sim:
        n = int(r["context_len"])
        assert float(r["piggyback_b0_ms"]) == pytest.approx(float(r["reread_ms"]), abs=1e-9)
        assert float(r["piggyback_b4_ms"]) == pytest.approx(piggyback_tax_s(cost, n, 512, 4, 64) * 1e3)
    real = [r for r in rows if r["source"] == "real"]
    assert [(r["context_len"], r["chunk_size"]) for r in real] == [("128", "64"), ("256", "64")]
    assert all(r["piggyback_b0_ms"] != "" and r["piggyback_b4_ms"] != "" for r in real)
    summary = json.loads((tmp_path / "crossover_summary.json").read_text())
    entry = next(e for e in summary if e["source"] == "sim" and e["link"] == "tcp-25")
    assert {"L_star_time", "L_star_piggyback_b0", "L_star_piggyback_b4", "L_star_piggyback_b4_layerwise"} <= set(entry)
    assert entry["L_star_piggyback_b0"] == entry["L_star_time"]
    assert result["summary"] == summary


# -- chunk_overhead, hybrid_batch ------------------------------------------------------------------------
def test_chunk_overhead_table_and_figure(tmp_path):
    cfg = from_dict({"wandb": {"mode": "disabled"}, "experiment": {
        "name": "chunk_overhead", "models": ["llama3-8b"], "hardware": ["h100-sxm"], "context_lens": [2048, 4096],
        "chunk_sizes": [512, 2048], "real_models": ["tiny"], "real_context_lens": [128, 256],
        "real_chunk_sizes": [64, 256], "repeats": 1}})
    result = execute(cfg, tmp_path)
    header, rows = read_csv(tmp_path / "chunk_overhead.csv")
    assert header == CHUNK_COLUMNS
    assert [(r["source"], r["model"], r["hardware"]) for r in rows] == \
        [("sim", "llama3-8b", "h100-sxm")] * 4 + [("sim", "tiny", "cpu")] * 4 + [("real", "tiny", "this-cpu")] * 4
    sim = {(int(r["prompt_len"]), int(r["chunk_size"])): float(r["overhead"]) for r in rows[:4]}
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    assert sim[(2048, 2048)] == 1.0
    assert sim[(4096, 512)] == pytest.approx(chunked_prefill_s(cost, 4096, 512)
                                             / cost.iteration_time_s([(4096, 4096)], num_sampled=1))
    assert sim[(4096, 512)] > sim[(4096, 2048)] > 1.0          # smaller chunks re-read more
    real = {(int(r["prompt_len"]), int(r["chunk_size"])): r for r in rows[8:]}
    assert real[(256, 256)]["chunked_ms"] == real[(256, 256)]["whole_ms"]   # one chunk is the whole prompt
    assert float(real[(256, 64)]["chunked_ms"]) > 0
    assert (tmp_path / "chunk_overhead.png").read_bytes()[:8] == PNG_MAGIC
    saved = json.loads((tmp_path / "experiment.json").read_text())
    assert saved["headline"] == result["headline"] and "rows" not in saved
    assert {(h["source"], h["prompt_len"]) for h in saved["headline"]} == {("sim", 2048), ("sim", 4096)}


def test_hybrid_batch_table_and_figure(tmp_path):
    cfg = from_dict({"wandb": {"mode": "disabled"}, "experiment": {
        "name": "hybrid_batch", "models": ["llama3-8b"], "hardware": ["h100-sxm"], "context_lens": [4096],
        "chunk_sizes": [512], "real_models": ["tiny"], "real_context_lens": [128], "real_chunk_sizes": [32, 128],
        "num_decodes": 3, "decode_context_len": 64, "repeats": 1}})
    execute(cfg, tmp_path)
    header, rows = read_csv(tmp_path / "hybrid_batch.csv")
    assert header == HYBRID_COLUMNS
    by = {(r["source"], r["model"], r["batch"], r["chunk_size"]): r for r in rows}
    cost = CostModel(load_model_preset("llama3-8b"), load_hardware_preset("h100-sxm"))
    decodes = [(1, 64)] * 3
    assert float(by[("sim", "llama3-8b", "decode_only", "0")]["iteration_ms"]) == \
        pytest.approx(cost.iteration_time_s(decodes) * 1e3)
    chunk = by[("sim", "llama3-8b", "decode+chunk", "512")]
    assert float(chunk["iteration_ms"]) == pytest.approx(cost.iteration_time_s(decodes + [(512, 4096)]) * 1e3)
    whole = by[("sim", "llama3-8b", "decode+whole_prefill", "4096")]
    assert float(whole["slowdown"]) > float(chunk["slowdown"]) > 1.0
    real = [r for r in rows if r["source"] == "real"]
    assert [(r["batch"], r["chunk_size"]) for r in real] == \
        [("decode_only", "0"), ("decode+whole_prefill", "128"), ("decode+chunk", "32")]
    assert float(real[0]["slowdown"]) == 1.0 and all(float(r["iteration_ms"]) > 0 for r in real)
    assert (tmp_path / "hybrid_batch.png").read_bytes()[:8] == PNG_MAGIC


# -- stall (on the simulator: the same policies and files, seconds instead of a minute) ------------------
@pytest.fixture(scope="module")
def stall_dir(tmp_path_factory):
    out = tmp_path_factory.mktemp("stall")
    from testbed.workloads.config import load_workload_preset
    cfg = from_dict({"runtime": {"name": "sim"}, "wandb": {"mode": "disabled"},
                     "experiment": {"name": "stall", "schedulers": ["vllm_v0", "orca", "sarathi"],
                                    "token_budgets": [256], "disagg_splits": ["1P1D"]}})
    # the decodes run ~0.1 s on the simulated cpu: the long prompts must land inside that
    cfg.workload = load_workload_preset("stall", inject_arrival_s=[0.03, 0.06], output_len=64)
    execute(cfg, out)
    return out


def test_stall_compares_the_four_policies(stall_dir):
    header, rows = read_csv(stall_dir / "stall.csv")
    assert [r["policy"] for r in rows] == ["vllm_v0", "orca", "sarathi-256", "disagg-1P1D"]
    assert {"tbt_p50_ms", "tbt_p99_ms", "tbt_max_ms"} <= set(header)
    tbt_max = {r["policy"]: float(r["tbt_max_ms"]) for r in rows}
    # a whole 1,800-token prefill stalls the decodes; 256-token chunks and a separate pool do not
    assert tbt_max["vllm_v0"] > 5 * tbt_max["sarathi-256"]
    assert tbt_max["orca"] > 3 * tbt_max["sarathi-256"]
    assert tbt_max["disagg-1P1D"] < tbt_max["sarathi-256"]
    for r in rows:
        summary = json.loads((stall_dir / r["run_dir"] / "summary.json").read_text())
        assert summary["num_finished"] == 10 and summary["tbt_ms"]["max"] == pytest.approx(float(r["tbt_max_ms"]))
    assert (stall_dir / "stall.png").read_bytes()[:8] == PNG_MAGIC


def test_report_writes_one_self_contained_page_per_experiment(stall_dir, tmp_path, capsys):
    assert report_main([str(stall_dir)]) == 0
    page = (stall_dir / "report.html").read_text()
    png = base64.b64encode((stall_dir / "stall.png").read_bytes()).decode()
    assert f"data:image/png;base64,{png}'" in page
    assert "src='http" not in page and "<link" not in page          # nothing outside the file
    assert page.count("<h3>stall.csv</h3>") == 1
    table = page.split("<h3>stall.csv</h3>")[1].split("</table>")[0]
    assert table.count("<tr>") == 5                                  # the header and one row per policy
    runs = page.split("<h2>Runs</h2>")[1]
    assert all(f"<th>{p}</th>" in runs for p in ("vllm_v0", "orca", "sarathi-256", "disagg-1P1D"))

    # two experiment directories into --out: a page each
    other = tmp_path / "hb"
    execute(from_dict({"wandb": {"mode": "disabled"}, "experiment": {
        "name": "hybrid_batch", "real": False, "models": ["llama3-8b"], "hardware": ["h100-sxm"],
        "context_lens": [4096], "chunk_sizes": [512], "real_models": []}}), other)
    assert report_main([str(stall_dir), str(other), "--out", str(tmp_path / "pages")]) == 0
    pages = sorted(p.name for p in (tmp_path / "pages").iterdir())
    assert pages == [f"report-1-{stall_dir.name}.html", "report-2-hb.html"]
    assert "experiment: hybrid_batch" in (tmp_path / "pages" / "report-2-hb.html").read_text()


# -- sweeps -----------------------------------------------------------------------------------------------
def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "WANDB_MODE": "disabled"}
    return subprocess.run([sys.executable, "-m", "testbed.cli", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=300)


def test_a_sweep_records_its_failed_point_and_the_report_lists_it(tmp_path):
    sweep = tmp_path / "sweep"
    proc = _cli("run", "-m", "runtime=sim", "token_budget=64,0", "workload.num_requests=4", "wandb.mode=disabled",
                f"hydra.sweep.dir={sweep}", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    good, bad = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert json.loads((good / "summary.json").read_text())["token_budget"] == 64
    why = "token_budget: must be an integer >= 1 or 'auto', got 0"
    assert json.loads((bad / "failed.json").read_text())["error"] == f"ValueError: {why}"

    proc = _cli("report", str(sweep), cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert f"failed: {bad}: ValueError: {why}" in proc.stdout
    page = (sweep / "report.html").read_text()
    assert "<h2>Failed points</h2>" in page and "token_budget: must be an integer &gt;= 1 or &#x27;auto&#x27;, got 0" in page
    assert page.count("data:image/png;base64,") == 1                 # the good point's TBT plot
    header = page.split("<h2>Runs side by side</h2>")[1].split("</tr>")[0]
    assert "<th>runtime=sim token_budget=64 workload.num_requests=4 wandb.mode=disabled</th>" in header


# -- capacity (the simulator; tiny workloads) -------------------------------------------------------------
def test_capacity_per_gpu_at_equal_gpu_count(tmp_path):
    spec = {"slo": {"ttft_ms": 400, "tbt_ms": 40}, "rate_start": 4.0, "max_probes": 5,
            "workload": {"num_requests": 16, "prompt_dist": "fixed", "prompt_len": 1024, "output_dist": "fixed",
                         "output_len": 16}}
    cfg = from_dict({"model": load_model_preset("llama3-8b"), "hardware": load_hardware_preset("h100-sxm"),
                     "link": load_link_preset("rdma-400"), "transfer": {"layerwise": True},
                     "wandb": {"mode": "disabled"},
                     "experiment": {"name": "capacity", "real": False, "schedulers": ["vllm_v0"],
                                    "token_budgets": [512], "disagg_splits": ["1P1D"], "rel_tol": 0.1,
                                    "workloads": {"fixed1k": spec}}})
    result = execute(cfg, tmp_path)
    _, rows = read_csv(tmp_path / "capacity.csv")
    _, probes = read_csv(tmp_path / "capacity_probes.csv")
    assert [(r["policy"], r["num_gpus"]) for r in rows] == [("vllm_v0", "2"), ("disagg-1P1D", "2")]
    for r in rows:
        mine = [p for p in probes if p["policy"] == r["policy"]]
        assert len(mine) == int(r["num_probes"]) <= 5
        rate = float(r["capacity_rps"])
        assert float(r["capacity_per_gpu"]) == pytest.approx(rate / 2)
        # the answer is a probe that met the SLOs, by its own run's summary
        best = next(p for p in mine if float(p["rate"]) == rate)
        assert best["meets_slo"] == "True"
        summary = json.loads((tmp_path / best["run_dir"] / "summary.json").read_text())
        assert summary["num_finished"] == 16 and summary["ttft_ms"]["p99"] <= 400 and summary["tbt_ms"]["p99"] <= 40
        # every probe above it failed, every probe at or below it passed
        assert all((p["meets_slo"] == "True") == (float(p["rate"]) <= rate) for p in mine)
        if r["bound"] == "found" and len(mine) < 5:
            assert float(r["first_failing_rps"]) / rate - 1 <= 0.1
    assert {c["policy"]: c["capacity_per_gpu"] for c in result["capacity_per_gpu"]} == \
        {r["policy"]: float(r["capacity_per_gpu"]) for r in rows}
    assert (tmp_path / "capacity.png").read_bytes()[:8] == PNG_MAGIC


def test_capacity_workload_without_slo_names_the_field(tmp_path):
    cfg = from_dict({"wandb": {"mode": "disabled"}, "experiment": {
        "name": "capacity", "workloads": {"code": {"preset": "azure_code", "rate": 3}}}})
    with pytest.raises(ValueError, match=r"experiment.workloads.code: give slo: \{ttft_ms, tbt_ms\}"):
        execute(cfg, tmp_path)
