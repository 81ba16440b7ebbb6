"""The decision study's Prober (testbed/experiments/decision_prober.py) on
the simulator: which probes that came out too short for the steady-state
rule it runs again, longer, and which it leaves."""
from __future__ import annotations

from testbed.config import from_dict
from testbed.steady_state import SteadyRule

from decision_case import DATA, ENGINE  # noqa: E402  (tests/ on sys.path: conftest)


def _four_second_requests():
    """A simulated run of the tiny model whose every iteration takes 10 ms
    (any batch): a request of a 64-token prompt and 400 output tokens is
    served in ~4 s."""
    from omegaconf import OmegaConf
    hardware = OmegaConf.to_container(OmegaConf.load(DATA / "decision_hardware.yaml"))
    return from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "disabled"},
                      "progress": False, "hardware": hardware, "engine": ENGINE, "token_budget": 1100,
                      "workload": {"name": "w", "arrival": "poisson", "rate": 1.0, "num_requests": 10,
                                   "prompt_dist": "fixed", "prompt_len": 64, "output_dist": "fixed",
                                   "output_len": 400}})


def _queued_transfers():
    """1P1D of the tiny model over a 0.01 Gb/s link: tiny's KV is 2 KiB a token, so a 64-token
    prompt's 128 KiB take ~0.1 s to cross; at 20 req/s the transfers queue without end."""
    from omegaconf import OmegaConf
    hardware = OmegaConf.to_container(OmegaConf.load(DATA / "decision_hardware.yaml"))
    return from_dict({"runtime": {"name": "sim"}, "mode": "disagg", "model": {"name": "tiny"},
                      "wandb": {"mode": "disabled"}, "progress": False, "hardware": hardware, "engine": ENGINE,
                      "token_budget": 1100, "link": {"name": "slow", "bandwidth_gbps": 0.01},
                      "workload": {"name": "w", "arrival": "poisson", "rate": 1.0, "num_requests": 10,
                                   "prompt_dist": "fixed", "prompt_len": 64, "output_dist": "fixed",
                                   "output_len": 16}})


def test_a_probe_too_short_to_judge_anyone_is_lengthened_not_counted_as_a_failure():
    """A probe whose every request finished but whose window holds none (its
    first size came from a service time far too short) says nothing: failing
    it sent a search below half its capacity (deepseek-v2-lite, sarathi-2048
    at 2K). It is re-run as long as the rule asks, even more than 3x longer; one
    made to rule a deployment out is not (an overloaded run's would grow without end)."""
    from testbed.experiments.decision_prober import Prober
    from testbed.experiments.decision_search import verdict
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    cfg = _four_second_requests()
    rule = SteadyRule(span_factor=10, min_judged=20, max_requests=2000)
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(ttft_ms=1e6, tbt_ms=1e6)
    prober = Prober(rule, lambda *_: None)
    # a first guess of 1 us per request: 30 requests at 20 req/s, arriving over ~1.5 s, while each
    # takes 4 s (400 iterations of 10 ms, any batch): the window [first + 4 s, last - 4 s] is empty
    assert rule.num_requests(20.0, 1e-6) == 30
    run = prober.probe(("k",), cfg, 20.0, 1e-6, lambda r: verdict(r, smooth, targets), "p99_tbt")
    assert run.num_requests > 3 * 30 and run.num_finished == run.num_requests
    assert run.window.judged and run.window.steady and 3.9 < run.window.service_s < 4.5
    # a probe to rule a deployment out (rule_out) is sized for that many judged requests and, not
    # passing, never lengthened: 140 requests over ~7 s, each 4 s long, judge none, in one run
    ruling = prober.probe(("k2",), cfg, 20.0, 1e-6, lambda r: verdict(r, smooth, targets), "p99_tbt", rule_out=100)
    assert ruling.num_requests == 140 and not ruling.num_judged and prober.rows[-1]["runs"] == 1
    assert verdict(run, smooth, targets) == ""


def test_a_ttft_miss_over_enough_judged_requests_is_settled_and_not_lengthened():
    """A failing probe too short for the steady-state rule is lengthened
    (at most 3x) to guard against a false failure: a p99 over a few judged
    requests is the worst single one's. A miss the Prober's SettledFailure
    names (the study's: TTFT, whose target every definition shares) over its
    judged requests or more is not run again; any other limit still is."""
    from testbed.experiments.decision_prober import Prober, SettledFailure
    from testbed.experiments.decision_search import verdict
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    cfg, rule = _four_second_requests(), SteadyRule(span_factor=10, min_judged=20, max_requests=2000)
    # every request's first token takes an iteration of 10 ms, every later one too: both targets missed
    late_ttft, late_tbt = SLOTargets(ttft_ms=5.0, tbt_ms=1e6), SLOTargets(ttft_ms=1e6, tbt_ms=5.0)
    # sized for a 1.5 s service time: 330 requests arriving over ~16.5 s, each ~4 s long, judge ~170
    # (the window [first + 4 s, last - 4 s]) and are not steady (16.5 s < 10 x 4 s); the rule then asks
    # for ~880, within 3x
    assert rule.num_requests(20.0, 1.5) == 330 and rule.num_requests(20.0, 4.2) <= 3 * 330

    def probe(targets, settled):
        prober = Prober(rule, lambda *_: None, settled=settled)
        limit = lambda r: verdict(r, get_smoothness("p99_tbt"), targets)
        run = prober.probe(("k",), cfg, 20.0, 1.5, limit, "p99_tbt")
        return run, prober.rows[-1]

    ttft = SettledFailure(("ttft",), 100)
    run, row = probe(late_ttft, ttft)
    assert run.num_requests == 330 and not run.window.steady and run.num_judged >= 100
    assert row["verdict"] == "ttft" and row["runs"] == 1
    lengthened, row = probe(late_ttft, SettledFailure(("ttft",), run.num_judged + 1))   # one judged short
    assert lengthened.num_requests > 2 * 330 and row["verdict"] == "ttft" and row["runs"] >= 2
    assert probe(late_ttft, None)[1]["runs"] == row["runs"]        # without one: as before
    assert probe(late_tbt, ttft)[1]["runs"] == row["runs"]         # a limit it does not name


def test_an_unjudged_probe_whose_queue_grew_with_it_is_settled_after_one_lengthening():
    """1P1D over a link that moves one prompt's KV in ~0.1 s, at 20 req/s: the
    transfers queue and every request waits longer than the one before, so the
    longest service time grows with the probe and no length judges anyone.
    Lengthened once (an unjudged probe says nothing: its first size may have come
    from too short a guess), its service time grew as its length did: a
    SettledFailure with growing_queue stops there; without, it runs once more,
    to the cap, and still judges none. A probe whose service time does not grow
    with it is lengthened as before."""
    from testbed.experiments.decision_prober import Prober, SettledFailure
    from testbed.experiments.decision_search import verdict
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    overloaded = _queued_transfers()
    rule = SteadyRule(span_factor=10, min_judged=20, max_requests=1000)
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(ttft_ms=1e6, tbt_ms=1e6)
    growing = SettledFailure(("ttft",), 100, growing_queue=True)

    def probe(cfg, settled, first_service_s):
        prober = Prober(rule, lambda *_: None, settled=settled)
        run = prober.probe(("k",), cfg, 20.0, first_service_s, lambda r: verdict(r, smooth, targets), "p99_tbt")
        return run, prober.rows[-1]["runs"]

    run, runs = probe(overloaded, growing, 0.2)
    assert runs == 2 and run.num_finished == run.num_requests < 1000 and not run.num_judged
    assert run.window.service_s > run.num_requests / 20.0 / 2          # waits of about the probe's own span
    run, runs = probe(overloaded, None, 0.2)
    assert runs == 3 and run.num_requests == 1000 and not run.num_judged
    # four-second requests on an idle link, first sized for 1 us: lengthened to steady, as without
    run, runs = probe(_four_second_requests(), growing, 1e-6)
    assert run.window.steady and runs == probe(_four_second_requests(), None, 1e-6)[1]


def test_a_failing_probe_to_rule_out_over_too_few_judged_requests_is_lengthened_once():
    """A probe at a rival's capacity (rule_out) is sized for that many judged
    requests from the service time it expects; where the requests take longer,
    it judges fewer. Failing there, it is run once more as long as its own
    service time asks, at most 3x longer, so that its failure can rule the
    deployment out; more than 3x (an overloaded run's service time grows with it),
    or judging none, it is left as it came."""
    from testbed.experiments.decision_prober import Prober
    from testbed.experiments.decision_search import verdict
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    cfg, rule = _four_second_requests(), SteadyRule(span_factor=10, min_judged=20, max_requests=2000)
    late_ttft = SLOTargets(ttft_ms=5.0, tbt_ms=1e6)

    def probe(rate, first_service_s):
        prober = Prober(rule, lambda *_: None)
        run = prober.probe(("k",), cfg, rate, first_service_s,
                           lambda r: verdict(r, get_smoothness("p99_tbt"), late_ttft), "p99_tbt", rule_out=100)
        return run, prober.rows[-1]["runs"]

    # expecting 1.5 s: 165 requests over ~16.5 s, each 4 s long, judge ~85; 4 s asks for ~440 (< 3 x 165)
    assert rule.num_requests(10.0, 1.5, None, 100) == 165 and rule.num_requests(10.0, 4.0, None, 100) <= 3 * 165
    run, runs = probe(10.0, 1.5)
    assert runs == 2 and run.num_judged >= 100 and verdict(run, get_smoothness("p99_tbt"), late_ttft) == "ttft"
    # at 20 req/s expecting 1.1 s: 242 requests judge ~80, and 4 s asks for more than 3x: one run
    assert rule.num_requests(20.0, 1.1, None, 100) == 242 and rule.num_requests(20.0, 4.0, None, 100) > 3 * 242
    run, runs = probe(20.0, 1.1)
    assert runs == 1 and 0 < run.num_judged < 100


def test_a_probe_to_rule_out_that_judged_none_is_lengthened_once_to_tell_an_overload():
    """A probe at a rival's capacity that judged no one says nothing by itself. With a
    SettledFailure that watches queues, it is run once more, twice as long: where the service
    time grew with it (queued transfers), the run is `overloaded` (its capacity lies below that
    rate), in that run rather than in one of the 1,000 requests the rule asks; where it did not
    (four-second requests first sized for 1 us), once more, as long as the rule asks, and it
    judges as usual."""
    from testbed.experiments.decision_prober import Prober, SettledFailure
    from testbed.experiments.decision_search import verdict
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    rule = SteadyRule(span_factor=10, min_judged=20, max_requests=1000)
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(ttft_ms=1e6, tbt_ms=1e6)

    def rule_out(cfg, first_service_s, settled):
        prober = Prober(rule, lambda *_: None, settled=settled)
        run = prober.probe(("k",), cfg, 20.0, first_service_s, lambda r: verdict(r, smooth, targets), "p99_tbt",
                           rule_out=100)
        return run, prober.rows[-1]["runs"]

    growing = SettledFailure(("ttft",), 100, growing_queue=True)
    run, runs = rule_out(_queued_transfers(), 0.2, growing)
    first = rule.num_requests(20.0, 0.2, None, 100)
    assert runs == 2 and not run.num_judged and run.overloaded and run.num_requests == 2 * first < 1000
    run, runs = rule_out(_queued_transfers(), 0.2, SettledFailure(("ttft",), 100))      # not watching queues
    assert runs == 1 and not run.num_judged and not run.overloaded
    run, runs = rule_out(_four_second_requests(), 1e-6, growing)
    assert runs == 3 and run.num_judged >= 100 and not run.overloaded


def test_a_rate_reached_two_ways_that_differs_in_its_last_bits_is_the_same_probe():
    """A rival's capacity per GPU times this deployment's GPUs may come out a few ulps off a rate
    already run on the key (23.607632516217684 against ...688 on the full grid's llama3-8b
    slice): the Prober gives the run it made, not a second one; a rate a tolerance step away
    is a new probe."""
    from testbed.experiments.decision_prober import Prober
    from testbed.experiments.decision_search import verdict
    from testbed.experiments.decision_slo import SLOTargets, get_smoothness
    cfg = _four_second_requests()
    smooth, targets = get_smoothness("p99_tbt"), SLOTargets(ttft_ms=1e6, tbt_ms=1e6)
    prober = Prober(SteadyRule(span_factor=10, min_judged=20, max_requests=2000), lambda *_: None)
    limit = lambda r: verdict(r, smooth, targets)
    rate = 0.1 * 3
    run = prober.probe(("k",), cfg, rate, 4.0, limit, "p99_tbt")
    runs = prober.num_runs
    assert rate != 0.3 and prober.probe(("k",), cfg, 0.3, 4.0, limit, "p99_tbt") is run
    assert prober.num_runs == runs and len(prober.rows) == 1
    assert prober.probe(("k",), cfg, 0.3 * 1.1, 4.0, limit, "p99_tbt") is not run and prober.num_runs > runs
