"""trace_format=otel: a vLLM server's OpenTelemetry trace replayed as it
arrived, and engine=vllm-v1 replaying the blis-h100 per-request runs."""
from __future__ import annotations

import gzip
import json
import statistics
import sys
from pathlib import Path

import pytest

SHARED = Path(__file__).resolve().parents[2] / "shared" / "data"

from testbed.workloads.readers import OtelReader


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


@pytest.mark.parametrize("run_name", ["jan21-llama7b-train-1", "jan20-codellama-train-1"])
def test_vllm_v1_replays_the_per_request_runs_within_15_percent(run_name, tmp_path):
    """The two vLLM 0.11 runs on one H100 (Llama-2-7B, CodeLlama-34B):
    mean and p50 TTFT and mean TPOT of the replay against the spans' own."""
    from testbed.analysis.blis_replay import per_request_runs, replay
    from testbed.sim.engine_config import load_engine_preset
    (run,) = [r for r in per_request_runs(SHARED / "blis-h100") if r.name == run_name]
    got = replay(run, load_engine_preset("vllm-v1"), tmp_path)
    assert got["num_requests"] == {"jan21-llama7b-train-1": 282, "jan20-codellama-train-1": 280}[run_name]
    assert set(run.measured) == {"ttft_mean", "ttft_p50", "tpot_mean"}
    for metric, measured in run.measured.items():
        assert abs(got[metric] / measured - 1) < 0.15, (metric, got[metric], measured)
