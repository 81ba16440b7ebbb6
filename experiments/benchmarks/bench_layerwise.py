"""Layer-wise KV streaming against whole-KV hand-off, on the real runtime.

The question (issue 4): over a link whose transfer time is about the prefill
time, how much of a 4K prompt's KV transfer does layer-wise streaming hide
behind the prefill? With L layers, layer i's KV can leave once layer i of the
prompt is computed; only the last layer (sent with the first token) and what
the link could not drain during the remaining layers stay exposed, so with
tiny's 4 layers about 1/4 of the transfer should show.

1. Time a whole prefill of the prompt on `tiny` in this process (one torch
   thread, as the workers run), least of --reps after a warm-up (the machine
   is shared: slower repeats waited for a core). Also time what streaming
   costs the compute thread per layer (pack the layer, hand it to the link).
2. Pick transfer.rate_gbps so the prompt's KV (2048 B/token x 4096 = 8 MiB on
   tiny) takes about that long: a `shaped` link (token bucket over zmq).
3. Run mode=disagg 1P1D twice on the same workload (--requests prompts of
   --prompt-len tokens, spaced so they never overlap, whole prefill on the
   prefill worker: token_budget = prompt length), transfer.layerwise=false
   and =true, each an ordinary run directory under --out.
4. Per mode, from requests.jsonl: the transfer (transfer_start_s ->
   transfer_end_s: first byte handed to the link -> KV complete on the decode
   worker) and its exposed part (exposed_transfer_s: first token sampled -> KV
   complete), medians over the requests; and the prefill iteration's duration
   in the run (iterations.jsonl), which is what the link has to hide behind.
   `hidden` = 1 - exposed / link time, link time = KV bytes / rate; `ideal`
   is the exposed time a stall-free forward pass over a FIFO link would leave
   at that prefill time (ideal_exposed_s), so a gap between the two is time
   the streaming itself lost.

    python experiments/benchmarks/bench_layerwise.py [--prompt-len 4096] [--requests 3] [--out DIR]
"""
from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch

from testbed.config import RunConfig, from_dict
from testbed.engine import WallClock
from testbed.request import Request
from testbed.run import execute
from testbed.runtime.build import build_engine


def measure_prefill_s(cfg: RunConfig, prompt_len: int, reps: int) -> tuple[float, float]:
    """(least, median) wall time of one whole prefill (the step that also
    samples the first token) of a prompt_len-token prompt, engine as the
    workers build it. On this shared 2-core machine the least is the estimate
    of what the prefill costs; the others waited for a core."""
    torch.set_num_threads(cfg.torch_threads)
    engine = build_engine(cfg, "prefill", WallClock())
    times = []
    for i in range(reps + 1):
        prompt = torch.randint(0, cfg.model.vocab_size, (prompt_len,),
                               generator=torch.Generator().manual_seed(i)).tolist()
        req = Request(f"p{i}", prompt, 2)
        engine.add_request(req)
        t0 = time.perf_counter()
        out = engine.step()
        dt = time.perf_counter() - t0
        assert out is not None and out.prefill_completed == [req], "the prompt did not prefill in one step"
        engine.release(req.request_id)
        if i:                                 # the first one warms up allocations and caches
            times.append(dt)
    return min(times), statistics.median(times)


def send_cost_s(cfg: RunConfig, prompt_len: int, rate_gbps: float) -> float:
    """What streaming costs the compute thread per layer: packing one layer of
    the prompt's KV out of the paged cache and handing it to the shaped link
    (whose own thread does the waiting), timed in this process over a real
    zmq connection; median of the model's layers."""
    from testbed.kv_transfer import make_receiver, make_sender, pack_kv
    tcfg = from_dict({"transfer": {"transport": "shaped", "shaped_inner": "zmq", "rate_gbps": rate_gbps}}).transfer
    m = cfg.model
    num_blocks = -(-prompt_len // 16)
    cache = torch.randn(m.num_layers, 2, num_blocks, 16, m.num_kv_heads, m.resolved_head_dim)
    blocks = list(range(num_blocks))
    times = []
    with make_receiver(tcfg) as receiver, make_sender(tcfg, name="bench") as sender:
        sender.connect("decode", receiver.address)
        for layer in range(m.num_layers):
            t0 = time.perf_counter()
            sender.send("decode", pack_kv(cache, (layer, layer + 1), blocks, blocks, prompt_len, "r", last=False))
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def ideal_exposed_s(link_s: float, prefill_s: float, num_layers: int) -> float:
    """Layer-wise with no stall: layer i leaves at (i+1)/L of the prefill (the
    last with the first token) onto a FIFO link taking link_s/L per layer.
    A link faster than the prefill leaves the last layer exposed; a slower
    one all it could not drain while the prefill ran."""
    return max(link_s / num_layers, link_s - prefill_s * (num_layers - 1) / num_layers)


def run_config(prompt_len: int, num_requests: int, gap_s: float, rate_gbps: float, layerwise: bool) -> RunConfig:
    blocks = 2 * (-(-prompt_len // 16) + 4)
    return from_dict({
        "mode": "disagg", "scheduler": "sarathi", "token_budget": prompt_len, "max_num_batched_tokens": prompt_len,
        "num_kv_blocks": blocks, "enable_prefix_caching": False, "progress": False, "timeout_s": 600,
        "wandb": {"mode": "disabled"},
        "workload": {"name": f"layerwise_{prompt_len}", "num_requests": num_requests, "arrival": "constant",
                     "rate": 1.0 / gap_s, "prompt_dist": "fixed", "prompt_len": prompt_len,
                     "output_dist": "fixed", "output_len": 4},
        "transfer": {"transport": "shaped", "shaped_inner": "zmq", "rate_gbps": rate_gbps, "layerwise": layerwise,
                     "timeout_s": 120},
    })


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def summarize_run(run_dir: Path, rate_bytes_per_s: float, layerwise: bool, num_layers: int) -> dict:
    recs = read_jsonl(run_dir / "requests.jsonl")
    bad = [(r["request_id"], r["status"], r["error"]) for r in recs if r["status"] != "finished"]
    if bad:
        raise RuntimeError(f"{run_dir}: requests did not finish: {bad}")
    prefill_its = [it["duration_s"] for it in read_jsonl(run_dir / "iterations.jsonl")
                   if it["worker"] == "prefill0" and it["num_prefill_tokens"] > 0]
    kv_bytes = statistics.median(r["kv_bytes_sent"] for r in recs)
    link_s = kv_bytes / rate_bytes_per_s
    exposed = statistics.median(r["exposed_transfer_s"] for r in recs)
    prefill_s = statistics.median(prefill_its)
    return {"prefill_s": prefill_s, "kv_mib": kv_bytes / 2**20, "link_s": link_s,
            "ideal_s": ideal_exposed_s(link_s, prefill_s, num_layers) if layerwise else link_s,
            "transfer_s": statistics.median(r["transfer_end_s"] - r["transfer_start_s"] for r in recs),
            "exposed_s": exposed, "hidden": 1.0 - exposed / link_s,
            "exposed_each_ms": [round(r["exposed_transfer_s"] * 1000) for r in recs]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--requests", type=int, default=3, help="prompts per run, one at a time")
    ap.add_argument("--reps", type=int, default=3, help="in-process prefill timings (after a warm-up)")
    ap.add_argument("--link-over-prefill", type=float, default=1.0,
                    help="the link's time for one prompt's KV, as a multiple of the measured prefill time")
    ap.add_argument("--out", type=Path, default=None, help="where the two run directories go (default: a temp dir)")
    args = ap.parse_args()

    base = run_config(args.prompt_len, args.requests, 1.0, 1.0, False)
    prefill_s, prefill_median_s = measure_prefill_s(base, args.prompt_len, args.reps)
    kv_bytes = args.prompt_len * base.model.kv_bytes_per_token
    link_target_s = prefill_s * args.link_over_prefill
    rate_gbps = kv_bytes * 8 / link_target_s / 1e9
    num_layers = base.model.num_layers
    print(f"tiny, {args.prompt_len}-token prompt: whole prefill {prefill_s * 1000:.0f} ms in process (least of "
          f"{args.reps}; median {prefill_median_s * 1000:.0f}); KV {kv_bytes / 2**20:.1f} MiB -> shaped link at "
          f"{rate_gbps * 1000:.1f} Mb/s ({link_target_s * 1000:.0f} ms per prompt)")
    print(f"streaming one layer costs the compute thread {send_cost_s(base, args.prompt_len, rate_gbps) * 1000:.2f} ms "
          f"(pack {kv_bytes / num_layers / 2**20:.0f} MiB out of the paged cache + hand it to the link thread), "
          f"of ~{prefill_s / num_layers * 1000:.0f} ms of compute per layer")

    out = args.out or Path(tempfile.mkdtemp(prefix="bench_layerwise-"))
    # one prompt at a time: prefill, the whole transfer and the few decodes fit in the gap
    gap_s = 3 * (prefill_s + link_target_s) + 1.0
    rows = {}
    for layerwise in (False, True):
        name = "layer-wise" if layerwise else "whole"
        run_dir = out / name
        execute(run_config(args.prompt_len, args.requests, gap_s, rate_gbps, layerwise), run_dir)
        rows[name] = summarize_run(run_dir, rate_gbps * 1e9 / 8, layerwise, num_layers)

    print(f"\n{'mode':<11} {'prefill ms':>10} {'KV MiB':>7} {'link ms':>8} {'transfer ms':>12} {'exposed ms':>11} "
          f"{'ideal ms':>9} {'hidden':>7}  exposed per request (ms)")
    for name, r in rows.items():
        print(f"{name:<11} {r['prefill_s'] * 1000:>10.0f} {r['kv_mib']:>7.1f} {r['link_s'] * 1000:>8.0f} "
              f"{r['transfer_s'] * 1000:>12.0f} {r['exposed_s'] * 1000:>11.0f} {r['ideal_s'] * 1000:>9.0f} "
              f"{r['hidden']:>7.0%}  {r['exposed_each_ms']}")
    print("(prefill: the prefill worker's iteration in the run; link: KV bytes / rate; transfer: first byte to the "
          "link -> KV complete on the decode worker; exposed: first token -> KV complete; ideal: exposed with no "
          "stall of the forward pass and a FIFO link; hidden: 1 - exposed / link)")
    whole, lw = rows["whole"], rows["layer-wise"]
    print(f"\nlayer-wise exposes {lw['exposed_s'] / whole['exposed_s']:.0%} of whole hand-off's exposed transfer; "
          f"hides {lw['hidden']:.0%} of the link time (target: at least 50%). Run directories: {out}")


if __name__ == "__main__":
    main()
