"""mode=disagg on the real runtime: a prefill worker process computes each
prompt and its first token, ships the paged KV over a real transport (zmq, or
gloo through torch.distributed) into blocks a decode worker process reserved,
and the decode worker generates the rest.

One small workload (8 requests, prompts 16-320 tokens cut into chunks of 64,
4-12 outputs, greedy) runs once colocated; every disaggregated variant (both
transports, whole and layer-wise, 1P1D and 1P2D) must generate exactly its
tokens, send exactly the prompt's KV bytes per request, record a consistent
transfer, and end with every KV block of every worker free.

A token that differs is reported with the top-2 logit margin of the reference
at that step (recomputed in this process), so a near-tie flip of fp32 rounding
can be told from a wrong KV."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from testbed.config import RunConfig, from_dict, to_dict
from testbed.engine import WallClock
from testbed.model.config import load_model_preset
from testbed.request import Request
from testbed.run import execute
from testbed.runtime.build import apply_sampling, build_engine
from testbed.workloads.build import build_workload

TOKEN_BUDGET = 64
WORKLOAD = {"name": "disagg_test", "num_requests": 8, "arrival": "poisson", "rate": 20.0,
            "prompt_dist": "uniform", "prompt_min": 16, "prompt_max": 320,
            "output_dist": "uniform", "output_min": 4, "output_max": 12}
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def config(**overrides) -> RunConfig:
    d = {"mode": "disagg", "token_budget": TOKEN_BUDGET, "workload": WORKLOAD, "wandb": {"mode": "disabled"},
         "progress": False, "timeout_s": 60, "transfer": {"timeout_s": 20}}
    for key, value in overrides.items():
        if isinstance(value, dict):
            d[key] = {**d.get(key, {}), **value}
        else:
            d[key] = value
    return from_dict(d)


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def workload(cfg: RunConfig) -> list[Request]:
    reqs = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, reqs)
    return reqs


def kv_bytes(prompt_len: int) -> int:
    """2 (K and V) * layers * kv heads * head dim * dtype bytes * tokens, from
    the preset's own fields (not the executor's kv_bytes_per_token)."""
    m = load_model_preset("tiny")
    head_dim = m.head_dim or m.hidden_size // m.num_heads
    return 2 * m.num_layers * m.num_kv_heads * head_dim * DTYPE_BYTES[m.dtype] * prompt_len


def top2_margin(cfg: RunConfig, req: Request, tokens: list[int], step: int) -> float:
    """The gap between the two largest logits when the reference sampled
    tokens[step]: the prompt plus tokens[:step] prefilled in this process."""
    torch.set_num_threads(1)
    ref_cfg = from_dict({**to_dict(cfg), "mode": "colocated", "num_kv_blocks": 256, "token_budget": 4096})
    engine = build_engine(ref_cfg, "colocated", WallClock())
    seen: list[torch.Tensor] = []
    compute_logits = engine.executor.model.compute_logits

    def spy(hidden: torch.Tensor) -> torch.Tensor:
        seen.append(compute_logits(hidden))
        return seen[-1]
    engine.executor.model.compute_logits = spy
    engine.add_request(Request("m", list(req.prompt_token_ids) + tokens[:step], 1))
    while engine.has_work():
        engine.step()
    top = torch.topk(seen[-1][-1], 2).values
    return float(top[0] - top[1])


def assert_same_tokens(cfg: RunConfig, got: dict[str, list[int]], ref: dict[str, list[int]]) -> None:
    reqs = {r.request_id: r for r in workload(cfg)}
    assert set(got) == set(ref)
    for rid in sorted(ref):
        diverged = next((i for i, (a, b) in enumerate(zip(got[rid], ref[rid])) if a != b), None)
        if diverged is not None:
            margin = top2_margin(cfg, reqs[rid], ref[rid], diverged)
            pytest.fail(f"{rid}: token {diverged} differs ({got[rid][diverged]} vs colocated {ref[rid][diverged]}); "
                        f"reference top-2 logit margin there {margin:.2e}")
        assert got[rid] == ref[rid], rid


@pytest.fixture(scope="module")
def colocated(tmp_path_factory) -> dict[str, list[int]]:
    out = tmp_path_factory.mktemp("colocated")
    execute(config(mode="colocated"), out)
    records = read_jsonl(out / "requests.jsonl")
    assert [r["status"] for r in records] == ["finished"] * len(records)
    return {r["request_id"]: r["output_token_ids"] for r in records}


CASES = [
    pytest.param("zmq", False, 1, id="zmq-whole-1P1D"),
    pytest.param("torch_dist", True, 1, id="gloo-layerwise-1P1D"),
    pytest.param("zmq", True, 2, id="zmq-layerwise-1P2D"),
    pytest.param("zmq", True, 1, id="zmq-layerwise-1P1D", marks=pytest.mark.slow),
    pytest.param("torch_dist", False, 1, id="gloo-whole-1P1D", marks=pytest.mark.slow),
    pytest.param("torch_dist", False, 2, id="gloo-whole-1P2D", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("transport,layerwise,decode_workers", CASES)
def test_disagg_generates_the_colocated_tokens(colocated, tmp_path, transport, layerwise, decode_workers):
    cfg = config(decode_workers=decode_workers, transfer={"transport": transport, "layerwise": layerwise})
    summary = execute(cfg, tmp_path)
    records = read_jsonl(tmp_path / "requests.jsonl")
    reqs = {r.request_id: r for r in workload(cfg)}
    assert [(r["request_id"], r["status"], r["error"]) for r in records] == \
        [(rid, "finished", None) for rid in reqs]
    assert_same_tokens(cfg, {r["request_id"]: r["output_token_ids"] for r in records}, colocated)

    for r in records:
        # exactly the prompt's KV, whatever the padding of its last block and however many payloads
        assert r["kv_bytes_sent"] == kv_bytes(reqs[r["request_id"]].prompt_len), r["request_id"]
        # the KV leaves the prefill worker by the time its first token reaches the client (engine
        # time vs arrival time at the frontend, one clock); the second token comes after it landed
        assert r["transfer_start_s"] <= r["first_token_s"]
        assert r["transfer_start_s"] <= r["transfer_end_s"] <= r["token_times_s"][1]
        assert 0 <= r["exposed_transfer_s"] <= r["transfer_end_s"] - r["transfer_start_s"] + 1e-9
        if not layerwise:      # whole: the KV leaves once the first token is out, so all of it is exposed
            assert r["exposed_transfer_s"] == pytest.approx(r["transfer_end_s"] - r["transfer_start_s"])
    kt = summary["kv_transfer"]
    assert (kt["num_transfers"], kt["bytes"]) == (8, sum(kv_bytes(r.prompt_len) for r in reqs.values()))

    workers = {"prefill0"} | {f"decode{i}" for i in range(decode_workers)}
    assert set(summary["workers"]) == workers
    assert summary["kv_blocks_leaked"] == {}
    assert all(s["all_free"] and s["num_free_blocks"] == s["num_blocks"] for s in summary["workers"].values())

    its = read_jsonl(tmp_path / "iterations.jsonl")
    by_role = {w: [it for it in its if it["worker"] == w] for w in workers}
    # the prefill worker computes every prompt token and nothing else; the decode workers every other token
    assert sum(it["num_prefill_tokens"] for it in by_role["prefill0"]) == sum(r.prompt_len for r in reqs.values())
    assert all(it["num_decode_tokens"] == 0 for it in by_role["prefill0"])
    decode_its = [it for w in workers - {"prefill0"} for it in by_role[w]]
    assert sum(it["num_decode_tokens"] for it in decode_its) == sum(r.max_tokens - 1 for r in reqs.values())
    assert all(it["num_prefill_tokens"] == 0 for it in decode_its)
    assert all(by_role[w] for w in workers), "a decode worker got no request"


def test_decode_worker_seats_at_most_max_num_seqs(colocated, tmp_path):
    """A burst whose KV lands while the one seat is taken: those requests wait
    in their reserved blocks and join as a seat frees, never running past
    max_num_seqs (which used to fail the decode worker's scheduler check)."""
    cfg = config(max_num_seqs=1, workload={"rate": 1000.0})
    summary = execute(cfg, tmp_path)
    records = read_jsonl(tmp_path / "requests.jsonl")
    assert [r["status"] for r in records] == ["finished"] * 8
    assert_same_tokens(cfg, {r["request_id"]: r["output_token_ids"] for r in records}, colocated)
    decode_its = [it for it in read_jsonl(tmp_path / "iterations.jsonl") if it["worker"] == "decode0"]
    assert max(it["num_decode_tokens"] for it in decode_its) == 1
    assert summary["kv_blocks_leaked"] == {}


def test_simulated_decode_worker_queues_past_max_num_seqs(tmp_path):
    cfg = from_dict({"mode": "disagg", "runtime": {"name": "sim"}, "max_num_seqs": 4, "wandb": {"mode": "disabled"},
                     "progress": False, "workload": {**WORKLOAD, "num_requests": 40, "rate": 500.0}})
    summary = execute(cfg, tmp_path)
    assert summary["num_finished"] == 40
    decode_its = [it for it in read_jsonl(tmp_path / "iterations.jsonl") if it["worker"] == "decode0"]
    assert max(it["num_decode_tokens"] for it in decode_its) == 4
    assert summary["kv_blocks_leaked"] == {}
