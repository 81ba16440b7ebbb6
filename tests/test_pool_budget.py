"""Per-pool batching (`prefill.token_budget`, `prefill.scheduler`, and the
same under `decode.`): a pool that sets them runs its workers with them, every
other worker with the run's `token_budget` and `scheduler` (mode=hybrid's
colocated pool among them). On the simulator, by which worker chunked what;
the config carries them to worker processes (from_dict); bad values name
the field."""
from __future__ import annotations

import pytest

from test_seams import config
from testbed.config import from_dict, to_dict, validate
from testbed.request import Request
from testbed.runtime.build import pool_config
from testbed.runtime.sim import SimRuntime
from testbed.schedulers.sarathi import SarathiScheduler
from testbed.schedulers.sarathi_srpt import SarathiSRPTScheduler

HYBRID = ["runtime=sim", "mode=hybrid", "hybrid.threshold=160", "token_budget=32", "prefill.token_budget=256",
          "prefill.scheduler=sarathi_srpt"]


def test_the_prefill_pool_chunks_at_its_own_budget_and_the_colocated_pool_at_the_runs():
    cfg = config(*HYBRID)
    rt = SimRuntime(cfg, log=lambda line: None)
    result = rt.run([Request("short", list(range(1, 101)), 4), Request("long", list(range(1, 201)), 4)])
    assert [r.status for r in result.records] == ["finished", "finished"]
    by_worker = {w: [it for it in result.iterations if it.worker == w and it.num_prefill_tokens]
                 for w in ("replica0", "prefill0")}
    # the 100-token prompt on the colocated replica: chunks of the run's 32
    assert [it.num_prefill_tokens for it in by_worker["replica0"]] == [32, 32, 32, 4]
    assert {it.token_budget for it in by_worker["replica0"]} == {32}
    # the 200-token prompt on the prefill worker: whole, within its pool's 256
    assert [(it.num_prefill_tokens, it.token_budget) for it in by_worker["prefill0"]] == [(200, 256)]
    schedulers = {w: type(s.engine.scheduler) for w, s in rt.services.items()}
    assert schedulers == {"replica0": SarathiScheduler, "prefill0": SarathiSRPTScheduler,
                          "decode0": SarathiScheduler}
    assert all(s["all_free"] for s in result.worker_stats.values())


def test_a_pool_that_sets_nothing_runs_with_the_runs_batching():
    cfg = config(*HYBRID)
    assert pool_config(cfg, "decode") is cfg and pool_config(cfg, None) is cfg
    prefill = pool_config(cfg, "prefill")
    assert (prefill.token_budget, prefill.scheduler) == (256, "sarathi_srpt")
    assert (cfg.token_budget, cfg.scheduler) == (32, "sarathi")


def test_worker_processes_read_the_pools_batching_from_the_config_dict():
    again = from_dict(to_dict(config(*HYBRID, "decode.token_budget=auto")))
    assert (again.prefill.token_budget, again.prefill.scheduler) == (256, "sarathi_srpt")
    assert (again.decode.token_budget, again.decode.scheduler) == ("auto", None)


@pytest.mark.parametrize("override,message", [
    ("prefill.token_budget=0", r"^prefill\.token_budget: must be an integer >= 1 or 'auto' \(or unset"),
    ("decode.token_budget=many", r"^decode\.token_budget: must be an integer >= 1 or 'auto'"),
    ("prefill.scheduler=nope", r"^prefill\.scheduler='nope' is not known; choose one of: adaptive, .*sarathi_srpt"),
])
def test_a_bad_pool_batching_names_its_field(override, message):
    with pytest.raises(ValueError, match=message):
        validate(config("runtime=sim", "mode=disagg", override))
