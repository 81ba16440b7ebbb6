"""Early rejection under mode=kvstore (Mooncake's): off by default; on, an
arriving request whose predicted TTFT breaks slo.ttft_ms is refused with
status `rejected`, counted apart in the summary and as a miss by goodput."""
from __future__ import annotations

import json

from testbed.config import from_dict
from testbed.run import execute

WORKLOAD = {"name": "burst", "num_requests": 40, "arrival": "poisson", "rate": 200.0, "prompt_dist": "fixed",
            "prompt_len": 2048, "output_dist": "fixed", "output_len": 8}


def config(**kv):
    return from_dict({"mode": "kvstore", "runtime": {"name": "sim"}, "wandb": {"mode": "disabled"},
                      "progress": False, "workload": WORKLOAD, "slo": {"ttft_ms": 1000.0, "tpot_ms": 100.0},
                      "token_budget": 512, "kvstore": kv})


def test_off_by_default_nothing_is_rejected(tmp_path):
    summary = execute(config(), tmp_path)
    assert summary["num_rejected"] == 0 and summary["num_finished"] == 40
    assert summary["ttft_ms"]["max"] > 1000         # the burst does break the SLO


def test_rejected_at_arrival_when_the_predicted_ttft_breaks_the_slo(tmp_path):
    summary = execute(config(early_rejection=True), tmp_path)
    recs = [json.loads(line) for line in (tmp_path / "requests.jsonl").read_text().splitlines()]
    rejected = [r for r in recs if r["status"] == "rejected"]
    assert rejected and summary["num_rejected"] == len(rejected)
    assert summary["num_finished"] + len(rejected) == 40
    assert all("predicted TTFT" in r["error"] and r["output_token_ids"] == [] for r in rejected)
    assert all(r["first_token_s"] is None for r in rejected)
    # goodput counts only finished requests within the SLOs: a rejection is a miss
    assert summary["slo_attainment"] <= summary["num_finished"] / 40
    assert summary["kv_blocks_leaked"] == {}
    # what was admitted fares better than without rejection
    unrejected = execute(config(), tmp_path / "off")
    assert summary["ttft_ms"]["p99"] < unrejected["ttft_ms"]["p99"]
    assert summary["ttft_ms"]["max"] <= 1000.0        # the ones admitted were predicted to meet it, and did
