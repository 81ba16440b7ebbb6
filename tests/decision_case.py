"""The decision study's constructed case, whose L* follows by hand (shared by
test_decision.py and test_restate_steady.py).

The case (tests/data/decision_*.yaml): every iteration takes
exactly 10 ms whatever its batch, and KV crosses the link at once. The TTFT
SLO is k = 3.5 times one GPU's whole prefill of L, i.e. 35 ms at every L; the
TBT SLO 50 ms; answers are 16 tokens; prompts are L within 0.5%.
- sarathi with a 1,100-token budget on 2 replicas prefills an L-token prompt
  in ceil(L / (1,100 - running decodes)) iterations. From L = 4,096 on that is
  at least 4 iterations, a TTFT of at least 40 ms > 35 ms even on an idle
  machine: no rate passes. At L <= 1,024 a prompt takes one iteration, and
  each replica prefills 1,100 tokens' worth of prompts per 10 ms.
- disagg 1P1D prefills whole prompts, up to max_num_batched_tokens = 1,100
  per 10 ms iteration (a longer one alone): it passes at every L (TTFT 10 ms
  plus the wait) and its decode worker decodes every running request every
  10 ms. Below 1,100 tokens its one prefill worker has half the prefill
  throughput of colocation's two replicas, and prefill is what binds both
  (decodes are free in a fixed-cost iteration): about half the capacity.
So disaggregation wins from L = 4,096 on and loses below: L* = 4,096."""
from __future__ import annotations

import csv
from pathlib import Path

from testbed.config import from_dict

DATA = Path(__file__).resolve().parent / "data"
GRID = [512, 1024, 4096, 8192]
ENGINE = {"name": "fixed-10ms", "overhead_ms": 10.0, "token_budget": 1100}     # for data/decision_hardware.yaml


def constructed(**experiment) -> object:
    e = dict(name="decision", models=["tiny"], hardware=[str(DATA / "decision_hardware.yaml")],
             links=[str(DATA / "decision_link.yaml")], context_lens=GRID, token_budgets=[1100],
             colocated=["sarathi"], ttft_k=3.5, tbt_slos_ms=[50],
             smoothness=["p99_tbt", "fluidity"], output_len=16, prompt_sigma=0.001,
             num_gpus=[2], rate_start=20.0, rel_tol=0.1, max_probes=10,
             span_factor=10.0, min_judged=20, max_requests_per_gpu=1000,
             real=False, parallel="1")
    e.update(experiment)
    return from_dict({"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "max_num_batched_tokens": 1100, "wandb": {"mode": "disabled"}, "progress": False,
                      "engine": ENGINE, "experiment": e})


def read_rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))
