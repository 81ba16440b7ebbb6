"""Capacity search (testbed/capacity.py): the SLO judgement, the binary search
on the simulator (the answer's probe meets the SLOs, the next higher probe
does not), capacity.json, and `testbed capacity` on the command line."""
import json

import pytest
from hydra import compose, initialize_config_dir
from omegaconf import OmegaConf

from testbed.capacity import find_capacity, judge, search_rate
from testbed.cli import main
from testbed.config import RunConfig, register_configs
from testbed.model.config import CONF_DIR

# llama3-8b on an H100: chat requests (~64-token prompts and answers) meet a
# 100 ms p99 TTFT at tens of requests/s and queue up past ~150 req/s
SMALL = ["runtime=sim", "model=llama3-8b", "hardware=h100-sxm", "workload=chat", "workload.num_requests=100",
         "workload.rate=16", "slo.ttft_ms=100", "slo.tpot_ms=50", "wandb.mode=disabled", "progress=false"]


def config(*overrides: str) -> RunConfig:
    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return OmegaConf.to_object(compose("config", list(overrides)))


def summary(n=10, done=10, ttft=50.0, tbt=20.0) -> dict:
    return {"num_requests": n, "num_finished": done, "ttft_ms": {"p99": ttft}, "tbt_ms": {"p99": tbt}}


def test_judge_names_the_first_broken_slo():
    assert judge(summary(), 100, 30) == (True, "ok")
    assert judge(summary(done=8), 100, 30) == (False, "2 of 10 requests did not finish")
    assert judge(summary(ttft=150.0), 100, 30) == (False, "p99 TTFT 150.0 ms > 100 ms")
    assert judge(summary(tbt=31.0), 100, 30) == (False, "p99 TBT 31.0 ms > 30 ms")
    assert judge(summary(ttft=100.0, tbt=30.0), 100, 30) == (True, "ok")      # at the SLO meets it


def test_sim_capacity_is_the_highest_passing_rate_below_the_lowest_failing_one(tmp_path):
    result = find_capacity(config(*SMALL), tmp_path, rel_tol=0.1, max_probes=12, log=lambda *_: None)
    probes = sorted(result.probes, key=lambda p: p.rate)
    assert result.rate is not None and result.first_failing_rate is not None
    at = next(p for p in probes if p.rate == result.rate)
    above = next(p for p in probes if p.rate > result.rate)
    assert at.meets_slo and at.ttft_p99_ms <= 100 and at.tbt_p99_ms <= 50 and at.num_finished == 100
    assert not above.meets_slo and above.rate == result.first_failing_rate
    assert result.first_failing_rate / result.rate - 1 <= 0.1
    # the simulator is deterministic and latency grows with load: a clean split
    assert all(p.meets_slo for p in probes if p.rate <= result.rate)
    assert not any(p.meets_slo for p in probes if p.rate >= result.first_failing_rate)
    assert probes[0].rate < 16 or probes[0].meets_slo          # started at workload.rate=16
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert saved["rate"] == result.rate and len(saved["probes"]) == len(result.probes)
    for p in saved["probes"]:
        run = json.loads((tmp_path / p["out_dir"].split("/")[-1] / "summary.json").read_text())
        assert run["ttft_ms"]["p99"] == p["ttft_p99_ms"]


def test_a_workload_without_a_rate_is_refused(tmp_path):
    with pytest.raises(ValueError, match="workload.arrival"):
        find_capacity(config(*SMALL, "workload.arrival=burst"), tmp_path)


def test_testbed_capacity_command(tmp_path, capsys):
    assert main(["capacity", "--out", str(tmp_path), "--rel-tol", "0.5", "--max-probes", "6", *SMALL]) == 0
    saved = json.loads((tmp_path / "capacity.json").read_text())
    assert saved["runtime"] == "sim" and saved["slo_ttft_ms"] == 100 and saved["slo_tbt_ms"] == 50
    assert 2 <= len(saved["probes"]) <= 6
    assert f"capacity: {saved['rate']:.4g} req/s" in capsys.readouterr().out
    assert main(["capacity", "--out", str(tmp_path / "x"), "model=nope"]) == 2
    assert "model='nope' is not a known preset" in capsys.readouterr().err


def _probed(capacity: float, start: float, **kw) -> list[float]:
    rates = []

    def probe(rate: float) -> bool:
        rates.append(rate)
        return rate <= capacity
    search_rate(probe, start, 0.1, 10, **kw)
    return rates


def test_search_rate_doubles_then_bisects_to_the_tolerance():
    assert _probed(10.0, 8.0) == pytest.approx([8.0, 16.0, 16 / 2 ** 0.5, 16 / 2 ** 0.75, 16 / 2 ** 0.625])
    assert _probed(10.0, 40.0)[:3] == [40.0, 20.0, 10.0]


@pytest.mark.parametrize("capacity, probes", [(9.5, 2), (9.0, 2), (10.5, 4), (30.0, 8), (3.0, 8)])
def test_search_rate_from_a_bracket_probes_its_ends_and_gallops_only_where_a_verdict_differs(capacity, probes):
    rates = _probed(capacity, 1.0, bracket=(9.2, 10.1))
    assert rates[0] == 9.2 and len(rates) == probes
    passed = [r for r in rates if r <= capacity]
    failed = [r for r in rates if r > capacity and r > max(passed)]
    assert max(passed) <= capacity < min(failed) <= max(passed) * 1.1 * (1 + 1e-9)     # the same 10% bracket


def test_a_bracket_that_still_holds_is_reprobed_on_the_very_same_rates():
    lo, hi = 7.3, 7.3 * 1.0905077326652577          # a bisection's bracket: hi is not lo * (hi / lo) in floats
    assert _probed(7.5, 1.0, bracket=(lo, hi)) == [lo, hi]


@pytest.mark.parametrize("bracket", [(1.0, 1.0), (2.0, 1.0), (0.0, 1.0), (1.0, 2.5)])
def test_search_rate_refuses_a_bracket_that_is_not_one(bracket):
    with pytest.raises(ValueError, match=r"search_rate: bracket must be \(lo, hi\) with 0 < lo < hi <= 2 lo, got"):
        search_rate(lambda rate: True, 1.0, 0.1, 10, bracket)
