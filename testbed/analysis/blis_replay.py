"""Replays of the blis-h100 dataset's vLLM serving runs on `runtime=sim`,
the end-to-end data engine=vllm-v1 is checked and calibrated against:

- the two vLLM 0.11 per-request runs (vllm-0.11-runs/<run>/traces.json.gz),
  replayed from their OpenTelemetry spans (workload.trace_format=otel) with
  the server's knobs (exp-config.yaml);
- the vLLM 0.15.1 aggregate runs (vllm-0.15-trainval.csv), replayed as
  nominal traces: Poisson arrivals per stage, each prompt one of
  prefix_groups shared system prompts (the prefix cache reuses it), then a
  question and the chat template's tokens, every output the run's mean
  output length. Such a replay reproduces a run's aggregates, not its
  requests: compare means, of the whole run and of each load stage.

    python -m testbed.analysis.blis_replay RUN [engine.FIELD=VALUE ...]
"""
from __future__ import annotations

import contextlib
import csv
import dataclasses
import io
import json
import statistics
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from testbed.config import from_dict
from testbed.data import dataset_dir
from testbed.model.config import load_model_preset
from testbed.run import execute
from testbed.sim.config import load_hardware_preset
from testbed.sim.engine_config import EngineConfig, load_engine_preset

DATASET = "blis-h100"
# the dataset's model names -> this project's model presets
MODELS = {"meta-llama/Llama-2-7b-hf": "llama2-7b", "Qwen/Qwen2.5-7B-Instruct": "qwen2.5-7b",
          "mistralai/Mistral-Nemo-Instruct-2407": "mistral-nemo-12b", "01-ai/Yi-34B": "yi-34b",
          "meta-llama/Llama-3.1-70B-Instruct": "llama3.1-70b", "Llama-2-7b-hf": "llama2-7b",
          "CodeLlama-34b-Instruct-hf": "codellama-34b",
          "RedHatAI/Llama-4-Scout-17B-16E-Instruct-FP8-dynamic": "llama4-scout-fp8"}
PER_REQUEST_RUNS = ("jan21-llama7b-train-1", "jan20-codellama-train-1")


@dataclass(frozen=True)
class Run:
    """One serving run: the server's knobs, its load and what was measured (ms)."""
    name: str
    model: str
    tp: int
    max_num_batched_tokens: int
    max_num_seqs: int
    num_kv_blocks: int | None
    measured: dict[str, float]          # ttft_mean, ttft_p50 (per-request runs), tpot_mean
    trace: Path | None = None           # per-request runs
    spec: dict | None = None            # aggregate runs: the workload spec's columns
    # aggregate runs: per load stage, its rate (req/s), duration (s) and measured
    # ttft_mean, tpot_mean, e2e_mean (ms)
    stages: tuple[dict[str, float], ...] = ()


def _number(text: str) -> float:
    return float(text.split(" ")[0])


def aggregate_runs(data: Path | None = None) -> tuple[list[Run], dict[str, str]]:
    """The vLLM 0.15.1 runs this project can replay, and the others with why not."""
    root = data or dataset_dir(DATASET, needed_by="testbed.analysis.blis_replay")
    runs, skipped = [], {}
    with open(root / "vllm-0.15-trainval.csv", newline="") as f:
        for r in csv.DictReader(f):
            if r["model"] not in MODELS:
                skipped[r["experiment"]] = f"no model preset for {r['model']}"
                continue
            if not r["stages_rps_x_s"]:
                skipped[r["experiment"]] = "no workload spec published"
                continue
            runs.append(Run(r["experiment"], MODELS[r["model"]], int(r["tp"]), int(r["max_num_batched_tokens"]),
                            int(r["max_num_seqs"]), int(_number(r["total_kv_blocks"])),
                            {"ttft_mean": float(r["ttft_mean"]), "tpot_mean": float(r["itl_mean"])},
                            spec={k: r[k] for k in ("stages_rps_x_s", "sys_prompt_len", "question_len",
                                                    "prefix_groups", "prompt_len_mean", "output_len_mean")},
                            stages=_stages(r)))
    return runs, skipped


def _stages(r: dict[str, str]) -> tuple[dict[str, float], ...]:
    """Each load stage's rate, duration and measured means. A one-stage run
    leaves its stage columns empty where they equal the whole run's."""
    specs = r["stages_rps_x_s"].split()
    stages = []
    for i, spec in enumerate(specs):
        rate, duration = (float(x) for x in spec.split("x"))
        measured = {k: float(r[f"stage{i}_{col}"] or (r[col] if len(specs) == 1 else "nan"))
                    for k, col in (("ttft_mean", "ttft_mean"), ("tpot_mean", "itl_mean"), ("e2e_mean", "e2e_mean"))}
        stages.append({"rate": rate, "duration_s": duration, **measured})
    return tuple(stages)


def per_request_runs(data: Path | None = None) -> list[Run]:
    import yaml
    root = data or dataset_dir(DATASET, needed_by="testbed.analysis.blis_replay")
    runs = []
    for name in PER_REQUEST_RUNS:
        folder = root / "vllm-0.11-runs" / name
        knobs = yaml.safe_load((folder / "exp-config.yaml").read_text())
        spans = list(_span_attributes(folder / "traces.json.gz"))
        ttft = [a["gen_ai.latency.time_to_first_token"] * 1e3 for a in spans]
        tpot = [(a["gen_ai.latency.e2e"] - a["gen_ai.latency.time_to_first_token"]) * 1e3
                / (int(a["gen_ai.usage.completion_tokens"]) - 1) for a in spans
                if int(a["gen_ai.usage.completion_tokens"]) > 1]
        model = MODELS[str(knobs["model"]).split("/")[-1]]
        runs.append(Run(name, model, int(knobs.get("tensor_parallelism", 1)), int(knobs["max_num_batched_tokens"]),
                        int(knobs["max_num_seqs"]), None,
                        {"ttft_mean": statistics.mean(ttft), "ttft_p50": statistics.median(ttft),
                         "tpot_mean": statistics.mean(tpot)}, trace=folder / "traces.json.gz"))
    return runs


def _span_attributes(path: Path):
    import gzip
    with gzip.open(path, "rt") as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        if span.get("name") == "llm_request":
                            yield {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}


def write_nominal_trace(run: Run, path: Path, vocab_size: int, seed: int = 0,
                        max_requests: int | None = None) -> int:
    """The run's nominal trace as JSONL (prompt_token_ids, max_tokens,
    arrival_s); returns the number of requests written."""
    s, rng = run.spec, np.random.default_rng(seed)
    sys_len, question_len, groups = int(s["sys_prompt_len"]), int(s["question_len"]), int(s["prefix_groups"])
    template = max(0, int(round(_number(s["prompt_len_mean"]))) - sys_len - question_len)
    output = max(2, int(round(float(s["output_len_mean"]))))
    prefixes = [rng.integers(1, vocab_size, sys_len).tolist() for _ in range(groups)]
    t0, lines = 0.0, []
    for stage in s["stages_rps_x_s"].split():
        rate, duration = (float(x) for x in stage.split("x"))
        t = t0 + rng.exponential(1 / rate)
        while t < t0 + duration:
            tokens = prefixes[rng.integers(groups)] + rng.integers(1, vocab_size, question_len + template).tolist()
            lines.append(json.dumps({"prompt_token_ids": tokens, "max_tokens": output, "arrival_s": round(t, 6)}))
            t += rng.exponential(1 / rate)
        t0 += duration
    lines = lines[:max_requests]
    path.write_text("\n".join(lines) + "\n")
    return len(lines)


def replay(run: Run, engine: EngineConfig, out_dir: Path, max_requests: int | None = None) -> dict[str, float]:
    """The replay's ttft_mean, ttft_p50 and tpot_mean (ms), TPOT as the dataset
    defines it: (E2E mean - TTFT mean) / (output mean - 1); for an aggregate
    run also stageI_ttft_mean and stageI_tpot_mean of the requests arriving in
    load stage I."""
    model = load_model_preset(run.model)
    if run.trace is None:
        trace = out_dir / "nominal.jsonl"
        write_nominal_trace(run, trace, model.vocab_size, max_requests=max_requests)
        workload = {"name": run.name, "arrival": "trace", "prompt_dist": "trace", "output_dist": "trace",
                    "trace_format": "jsonl", "trace_path": str(trace)}
    else:
        workload = {"name": run.name, "arrival": "trace", "prompt_dist": "trace", "output_dist": "trace",
                    "trace_format": "otel", "trace_path": str(run.trace), "max_requests": max_requests}
    hardware = load_hardware_preset("h100-sxm")
    cfg = from_dict({"runtime": {"name": "sim"}, "model": dataclasses.asdict(model),
                     "hardware": dataclasses.asdict(hardware), "engine": dataclasses.asdict(engine),
                     "parallel": {"tp": run.tp}, "wandb": {"mode": "disabled"}, "progress": False,
                     "max_num_seqs": run.max_num_seqs, "token_budget": run.max_num_batched_tokens,
                     "max_num_batched_tokens": run.max_num_batched_tokens, "enable_prefix_caching": True,
                     "num_kv_blocks": run.num_kv_blocks or "auto", "timeout_s": 1e6, "workload": workload})
    if run.num_kv_blocks is None:
        cfg = dataclasses.replace(cfg, num_kv_blocks=cfg.kv_blocks_from_memory(cfg.parallel))
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        execute(cfg, out_dir)
    records = [json.loads(line) for line in open(out_dir / "requests.jsonl")]
    got = {**_means(records), "ttft_p50": statistics.median(_ttft_ms(r) for r in records),
           "num_requests": len(records)}
    start = 0.0
    for i, stage in enumerate(run.stages):
        end = start + stage["duration_s"]
        arrived = [r for r in records if start <= r["arrival_s"] < end]
        if arrived:
            got.update({f"stage{i}_{k}": v for k, v in _means(arrived).items()})
        start = end
    return got


def _ttft_ms(r: dict) -> float:
    return (r["first_token_s"] - r["arrival_s"]) * 1e3


def _means(records: list[dict]) -> dict[str, float]:
    """ttft_mean and tpot_mean (ms) of request records, TPOT as the dataset defines it."""
    ttft = statistics.mean(_ttft_ms(r) for r in records)
    e2e = statistics.mean((r["finish_s"] - r["arrival_s"]) * 1e3 for r in records)
    outputs = statistics.mean(len(r["output_token_ids"]) for r in records)
    return {"ttft_mean": ttft, "tpot_mean": (e2e - ttft) / (outputs - 1)}


def main(argv: list[str]) -> int:
    runs = {r.name: r for r in per_request_runs() + aggregate_runs()[0]}
    if not argv or argv[0] not in runs:
        print(f"usage: blis_replay.py RUN [engine.FIELD=VALUE ...]; runs: {', '.join(runs)}", file=sys.stderr)
        return 2
    engine = load_engine_preset("vllm-v1")
    for override in argv[1:]:
        key, _, value = override.removeprefix("engine.").partition("=")
        engine = dataclasses.replace(engine, **{key: type(getattr(engine, key))(value)})
    run = runs[argv[0]]
    with tempfile.TemporaryDirectory() as tmp:
        got = replay(run, engine, Path(tmp))
    for k, v in run.measured.items():
        print(f"{k:10s} measured {v:9.2f}  replayed {got[k]:9.2f}  ({got[k] / v - 1:+.1%})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
