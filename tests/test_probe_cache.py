"""The decision study's probe cache (testbed/experiments/probe_cache.py): a
study cut short resumes from the probes it already ran and writes the rows a
whole run writes; a definition that never judged a cached probe runs it
again; entries of other code are not replayed; a cache that disagrees with
a re-run is refused."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest

from testbed.experiments.decision import run_decision
from testbed.experiments.decision_real import RealProbes
from testbed.experiments.decision_prober import Prober
from testbed.experiments.probe_cache import ProbeCache
from testbed.steady_state import SteadyRule
from tests.test_decision import constructed

GRID = [512, 1024, 4096]


def study(out: Path, cache: Path | None, **experiment) -> tuple[dict, list[str]]:
    """Run the constructed study into `out`; its summary and what it logged."""
    lines: list[str] = []
    out.mkdir()
    cfg = constructed(context_lens=GRID, probe_cache=str(cache) if cache else "", **experiment)
    run_decision(cfg, out, lambda *a: lines.append(" ".join(map(str, a))))
    return json.loads((out / "decision_summary.json").read_text()), lines


def probe_rows(out: Path) -> list[dict]:
    with open(out / "decision_probes.csv", newline="") as f:
        return list(csv.DictReader(f))


def cache_lines(cache: Path) -> list[dict]:
    return [json.loads(line) for path in sorted(cache.glob("*.jsonl")) for line in path.read_text().splitlines()]


def test_a_study_run_again_replays_every_probe_and_writes_the_same_rows(tmp_path):
    cache = tmp_path / "cache"
    first, _ = study(tmp_path / "a", cache)
    again, said = study(tmp_path / "b", cache)
    assert first["num_probe_runs"] > 10 and first["num_replayed_probes"] == 0
    # every run of the first (lengthened ones included) is replayed, none made
    assert again["num_probe_runs"] == 0 and again["num_replayed_probes"] == first["num_probe_runs"]
    assert (tmp_path / "a" / "decision.csv").read_bytes() == (tmp_path / "b" / "decision.csv").read_bytes()
    assert first["crossovers"] == again["crossovers"]
    # the probe rows keep the wall and CPU time each probe took when it ran; only `cached` tells them apart
    a, b = probe_rows(tmp_path / "a"), probe_rows(tmp_path / "b")
    assert all(float(r["cpu_s"]) >= 0 for r in a) and sum(float(r["cpu_s"]) for r in a) > 0
    assert again["probe_cpu_s"] == first["probe_cpu_s"] == round(sum(float(r["cpu_s"]) for r in a), 1)
    # the probes' wall time survives the replay too, where the replay's own elapsed_s does not
    assert again["probe_wall_s"] == first["probe_wall_s"] == round(sum(float(r["wall_s"]) for r in a), 1)
    assert {r["cached"] for r in a} == {"False"} and {r["cached"] for r in b} == {"True"}
    assert [{**r, "cached": ""} for r in a] == [{**r, "cached": ""} for r in b]
    assert any(f"{first['num_probe_runs']} probes of this code" in line for line in said)


def test_a_study_cut_short_resumes_where_it_stopped(tmp_path):
    """The cache of a process killed mid-study: its first half, and a torn last line."""
    whole, _ = study(tmp_path / "whole", None)
    cache = tmp_path / "cache"
    study(tmp_path / "a", cache)
    [path] = cache.glob("*.jsonl")
    lines = path.read_text().splitlines(keepends=True)
    path.write_text("".join(lines[:len(lines) // 2]) + lines[len(lines) // 2][:40])
    resumed, said = study(tmp_path / "b", cache)
    assert 0 < resumed["num_replayed_probes"] and 0 < resumed["num_probe_runs"] < whole["num_probe_runs"]
    assert any("1 torn lines skipped" in line for line in said)
    assert (tmp_path / "whole" / "decision.csv").read_bytes() == (tmp_path / "b" / "decision.csv").read_bytes()
    timing = {"wall_s": "", "cpu_s": "", "load_1m": "", "cached": ""}
    assert [{**r, **timing} for r in probe_rows(tmp_path / "whole")] == \
        [{**r, **timing} for r in probe_rows(tmp_path / "b")]


def test_a_definition_that_never_judged_a_cached_probe_runs_it_again(tmp_path):
    cache = tmp_path / "cache"
    study(tmp_path / "a", cache, smoothness=["p99_tbt"])
    assert {k.split()[0] for e in cache_lines(cache) for k in e["verdicts"]} == {"p99_tbt"}
    both, _ = study(tmp_path / "b", cache)
    fresh, _ = study(tmp_path / "fresh", None)
    # fluidity needs the records of the probes p99_tbt judged: those run again (and agree)
    assert 0 < both["num_probe_runs"] < fresh["num_probe_runs"] and both["num_replayed_probes"] > 0
    assert (tmp_path / "b" / "decision.csv").read_bytes() == (tmp_path / "fresh" / "decision.csv").read_bytes()
    assert {k.split()[0] for e in cache_lines(cache) for k in e["verdicts"]} == {"p99_tbt", "fluidity"}
    # ... and now every verdict is cached
    third, _ = study(tmp_path / "c", cache)
    assert third["num_probe_runs"] == 0


def test_entries_of_other_code_are_not_replayed(tmp_path):
    cache = tmp_path / "cache"
    first, _ = study(tmp_path / "a", cache)
    for path in cache.glob("*.jsonl"):
        path.write_text("".join(json.dumps({**e, "stamp": "0" * 16}) + "\n"
                                for e in map(json.loads, path.read_text().splitlines())))
    again, said = study(tmp_path / "b", cache)
    assert again["num_replayed_probes"] == 0 and again["num_probe_runs"] == first["num_probe_runs"]
    assert any("lines of other code versions ignored" in line for line in said)


def test_a_cache_that_a_re_run_contradicts_is_refused(tmp_path):
    cache = tmp_path / "cache"
    study(tmp_path / "a", cache, smoothness=["p99_tbt"])
    for path in cache.glob("*.jsonl"):
        path.write_text("".join(json.dumps({**e, "service_s": e["service_s"] * 1.5}) + "\n"
                                for e in map(json.loads, path.read_text().splitlines())))
    with pytest.raises(RuntimeError, match="delete that directory"):
        study(tmp_path / "b", cache)


def test_real_probes_are_never_replayed(tmp_path):
    with pytest.raises(ValueError, match="experiment.probe_cache: only simulated probes"):
        Prober(SteadyRule(3.0, 3, 12), print, RealProbes(tmp_path / "real"), cache=ProbeCache(tmp_path / "c"))


def test_the_key_ignores_what_a_simulated_run_never_reads():
    a = constructed(num_gpus=[2])
    b = constructed(num_gpus=[4], probe_cache="/elsewhere")
    assert ProbeCache.key(a) == ProbeCache.key(b)
    import dataclasses
    assert ProbeCache.key(dataclasses.replace(a, seed=a.seed + 1)) != ProbeCache.key(a)
