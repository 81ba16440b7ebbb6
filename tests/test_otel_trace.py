"""trace_format=otel: a vLLM server's OpenTelemetry trace replayed as it
arrived, and engine=vllm-v1 replaying one of the blis-h100 calibration runs."""
from __future__ import annotations

import dataclasses
import gzip
import json
import statistics
from pathlib import Path

import pytest

from data_fixture import SHARED  # noqa: E402

from testbed.workloads.otel_reader import OtelReader


def _span(start_ns: int, prompt: int, max_tokens: int, name: str = "llm_request") -> dict:
    return {"name": name, "startTimeUnixNano": str(start_ns), "attributes": [
        {"key": "gen_ai.usage.prompt_tokens", "value": {"intValue": str(prompt)}},
        {"key": "gen_ai.request.max_tokens", "value": {"intValue": str(max_tokens)}}]}


def _export(*spans) -> str:
    return json.dumps({"resourceSpans": [{"scopeSpans": [{"spans": list(spans)}]}]})


def test_spans_become_requests_at_their_start_in_time_order(tmp_path):
    path = tmp_path / "traces.json.gz"
    t0 = 1769021450278127360
    lines = [_export(_span(t0 + 2_500_000_000, 30, 7), _span(t0 + 1_000, 12, 5, name="other")),
             _export(_span(t0, 100, 20), _span(t0 + 1_000_000, 8, 3))]
    path.write_bytes(gzip.compress(("\n".join(lines) + "\n").encode()))
    rows = OtelReader().read(path)
    assert [(r.line, r.prompt_len, r.output_len, r.arrival_s) for r in rows] == [
        (2, 100, 20, 0.0), (2, 8, 3, pytest.approx(1e-3, abs=1e-15)), (1, 30, 7, pytest.approx(2.5, abs=1e-15))]
    assert [r.prompt_len for r in OtelReader().read(path, limit=2)] == [100, 8]


@pytest.mark.parametrize("line,error", [
    ("{\"spans\": []}", "not an OTLP JSON export"),
    (_export({"name": "llm_request", "startTimeUnixNano": "1", "attributes": []}), "lacks"),
    (_export(_span(1, 0, 5)), "gen_ai.usage.prompt_tokens='0' must be >= 1"),
    ("{not json", "not valid JSON"),
])
def test_a_bad_line_names_file_and_line(tmp_path, line, error):
    path = tmp_path / "t.json"
    path.write_text(_export(_span(1, 4, 4)) + "\n" + line + "\n")
    with pytest.raises(ValueError, match=f"^{path}:2: .*{error}"):
        OtelReader().read(path)


def test_vllm_v1_replays_the_llama7b_run_within_15_percent(tmp_path):
    """jan21-llama7b-train-1 (vLLM 0.11, one H100): mean and p50 TTFT, mean
    TPOT of the replay against the spans' own."""
    from testbed.config import from_dict
    from testbed.run import execute
    trace = SHARED / "blis-h100" / "vllm-0.11-runs" / "jan21-llama7b-train-1" / "traces.json.gz"
    from testbed.model.config import load_model_preset
    from testbed.sim.config import load_hardware_preset
    from testbed.sim.engine_config import load_engine_preset
    cfg = from_dict({"runtime": {"name": "sim"}, "model": dataclasses.asdict(load_model_preset("llama2-7b")),
                     "hardware": dataclasses.asdict(load_hardware_preset("h100-sxm")),
                     "engine": dataclasses.asdict(load_engine_preset("vllm-v1")),
                     "wandb": {"mode": "disabled"}, "progress": False,
                     # the server's knobs (exp-config.yaml)
                     "max_num_seqs": 256, "token_budget": 4096, "max_num_batched_tokens": 4096,
                     "num_kv_blocks": 7600,      # what one H100 holds after the weights (the run header)
                     "workload": {"name": "otel", "arrival": "trace", "prompt_dist": "trace", "output_dist": "trace",
                                  "trace_format": "otel", "trace_path": str(trace)}})
    execute(cfg, tmp_path)
    sim = [json.loads(line) for line in open(tmp_path / "requests.jsonl")]
    real = [a for a in _span_attributes(trace)]
    sim_ttft = [(r["first_token_s"] - r["arrival_s"]) * 1e3 for r in sim]
    real_ttft = [a["gen_ai.latency.time_to_first_token"] * 1e3 for a in real]
    sim_tpot = [(r["finish_s"] - r["first_token_s"]) / (len(r["output_token_ids"]) - 1) * 1e3 for r in sim
                if len(r["output_token_ids"]) > 1]
    real_tpot = [(a["gen_ai.latency.e2e"] - a["gen_ai.latency.time_to_first_token"])
                 / (int(a["gen_ai.usage.completion_tokens"]) - 1) * 1e3 for a in real
                 if int(a["gen_ai.usage.completion_tokens"]) > 1]
    assert len(sim) == len(real) == 282
    for name, s, r in (("mean TTFT", statistics.mean(sim_ttft), statistics.mean(real_ttft)),
                       ("p50 TTFT", statistics.median(sim_ttft), statistics.median(real_ttft)),
                       ("mean TPOT", statistics.mean(sim_tpot), statistics.mean(real_tpot))):
        assert abs(s / r - 1) < 0.15, (name, s, r)


def _span_attributes(path: Path):
    with gzip.open(path, "rt") as f:
        for line in f:
            for rs in json.loads(line)["resourceSpans"]:
                for ss in rs["scopeSpans"]:
                    for span in ss["spans"]:
                        yield {a["key"]: next(iter(a["value"].values())) for a in span["attributes"]}
