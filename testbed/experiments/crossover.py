"""The crossover study (experiments/README.md, "crossover"): for each model,
hardware, link, chunk size C and context length L, the chunk re-read tax of
colocation against the transfer tax of disaggregation.

Two sources, one table (crossover.csv, column `source`):
- `sim`: the cost and link models (testbed/sim/crossover.py) over the grid;
- `real`: the real engine on this machine (tiny and mid models): whole vs
  chunked prefill timed on the model executor, and the prompt's KV timed over
  real transports between two processes (zmq, gloo, shaped links). The same
  models also get `sim` rows on the `cpu` hardware profile, so measured and
  modeled curves share a figure.
Two chunk taxes answer two questions (experiments/README.md):
- isolated (`reread_ms`): chunked minus whole prefill of a prompt running
  alone; every chunk re-streams the weights, so this is what chunking costs on
  an otherwise idle GPU;
- piggybacked (`piggyback_b{B}_ms`, B in experiment.piggyback_decodes): what
  the chunks add to iterations of B running decodes at context
  experiment.decode_context_len, minus the whole prefill alone; the decodes
  stream the weights anyway, so this is what chunking costs a loaded
  colocated server (sim/crossover.py: piggyback_tax_s). Measured rows time the
  same batches on the model executor (prefill.py's RealBench).
crossover_summary.json gives L* per model/hardware/link/chunk: by bytes over
bandwidth (closed form and scanned) and by time (transfer, and exposed
transfer with layer-wise streaming), for the isolated tax and for each
piggyback tax; null where they never cross in range."""
from __future__ import annotations

import csv
import dataclasses
import json
import time
from pathlib import Path

import torch

from testbed.config import RunConfig
from testbed.experiments import save_figure
from testbed.kv_transfer import TransferConfig
from testbed.model.config import load_model_preset
from testbed.sim.config import LinkConfig, link_preset_names, load_hardware_preset, load_link_preset
from testbed.sim.cost_model import CostModel
from testbed.sim.crossover import (CrossoverPoint, chunked_prefill_s, closed_form_crossover, crossover_by_bytes,
                                   crossover_by_time, crossover_point, piggyback_tax_s, reread_bytes, transfer_bytes)
from testbed.sim.link_model import LinkModel
from testbed.batch import ScheduledSlice

LINK_PRESETS = set(link_preset_names())
POINT_COLUMNS = [f.name for f in dataclasses.fields(CrossoverPoint)]


def piggyback_column(num_decodes: int) -> str:
    return f"piggyback_b{num_decodes}_ms"


def columns(piggyback_decodes) -> list[str]:
    return POINT_COLUMNS + [piggyback_column(b) for b in piggyback_decodes] + ["source", "transport"]


def _sim_rows(models, hardware, links, chunks, contexts, piggyback_decodes, decode_context,
              engine=None) -> list[dict]:
    """The grid's rows; the prefill side (chunked time, piggyback taxes) is
    priced once per prompt and shared by every link. engine None: each
    hardware's default engine."""
    rows = []
    link_models = [LinkModel(load_link_preset(link) if isinstance(link, str) else link) for link in links]
    for m in models:
        mcfg = load_model_preset(m)
        for hw in hardware:
            cost = CostModel(mcfg, load_hardware_preset(hw), engine=engine)
            for c in chunks:
                for n in contexts:
                    chunked = chunked_prefill_s(cost, n, c)
                    piggy = {piggyback_column(b): piggyback_tax_s(cost, n, c, b, decode_context) * 1e3
                             for b in piggyback_decodes}
                    for lm in link_models:
                        row = dataclasses.asdict(crossover_point(cost, lm, c, n, chunked_s=chunked))
                        rows.append(row | piggy | {"source": "sim", "transport": ""})
    rows.sort(key=lambda r: (r["model"], r["hardware"], r["link"], r["chunk_size"], r["context_len"]))
    return rows


# -- the real engine ---------------------------------------------------------------------------------
def _prefill_s(executor, bm, scheduler_cfg, prompt: list[int], chunk: int | None, repeats: int) -> float:
    """Median time of prefilling `prompt` alone, whole (chunk None) or in chunks:
    this thread's CPU time (the engine runs on torch_threads=1 here), which
    other processes sharing the cores do not inflate the way they do wall time."""
    from testbed.engine import Engine, WallClock
    from testbed.request import Request
    from testbed.schedulers import make_scheduler
    times = []
    for rep in range(repeats):
        budget = chunk or len(prompt)
        sched = make_scheduler("sarathi", dataclasses.replace(scheduler_cfg, token_budget=budget), bm)
        eng = Engine(sched, executor, WallClock())
        eng.add_request(Request(f"x{rep}", prompt, max_tokens=1))
        bm.reset_prefix_cache()
        t0 = time.thread_time()
        while eng.has_work():
            eng.step()
        times.append(time.thread_time() - t0)
    return sorted(times)[len(times) // 2]


def _real_rows(cfg: RunConfig, log) -> list[dict]:
    from testbed.block_manager import BlockManager
    from testbed.experiments.transfer_probe import measure_transfer_s
    from testbed.model_executor import ModelExecutor
    from testbed.schedulers import SchedulerConfig
    ex_cfg = cfg.experiment
    torch.set_num_threads(cfg.torch_threads)
    rows = []
    for m in ex_cfg.real_models:
        mcfg = load_model_preset(m, dtype="float32")
        contexts = [n for n in ex_cfg.real_context_lens if n <= ex_cfg.real_max_tokens]
        if not contexts:
            continue
        block_size = cfg.block_size
        num_blocks = -(-max(contexts) // block_size) + 1
        bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
        ex = ModelExecutor(mcfg, num_blocks, block_size, bm.block_table)
        sched_cfg = SchedulerConfig(token_budget=1, max_num_seqs=1, max_num_batched_tokens=max(contexts))
        kv = mcfg.kv_bytes_per_token
        gen = torch.Generator().manual_seed(cfg.seed)
        # the transfer tax, measured: each transport moves each prompt's KV between two processes
        transfers: dict[str, dict[int, float]] = {}
        for t in ex_cfg.real_transports:
            transfers[t] = measure_transfer_s(TransferConfig(transport=t, timeout_s=120), ex.kv_cache, contexts,
                                              ex_cfg.repeats)
        for gbps in ex_cfg.real_link_gbps:
            shaped = TransferConfig(transport="shaped", rate_gbps=gbps, timeout_s=300)
            transfers[f"shaped-{gbps:g}g"] = measure_transfer_s(shaped, ex.kv_cache, contexts, 1)
        piggy = _measured_piggyback(cfg, m, contexts, log)
        for n in contexts:
            prompt = torch.randint(0, mcfg.vocab_size, (n,), generator=gen).tolist()
            whole = _prefill_s(ex, bm, sched_cfg, prompt, None, ex_cfg.repeats)
            per_layer = whole / mcfg.num_layers
            for c in ex_cfg.real_chunk_sizes:
                # a prompt within one chunk is not chunked: same computation, no re-read
                chunked = whole if n <= c else _prefill_s(ex, bm, sched_cfg, prompt, c, ex_cfg.repeats)
                for t, measured in transfers.items():
                    tr = measured[n]
                    # the link measured end to end, streamed layer by layer behind the prefill
                    measured_link = LinkModel(LinkConfig(name=t, bandwidth_gbps=kv * n * 8 / tr / 1e9))
                    exposed = measured_link.layerwise_exposed_s(per_layer, kv * n / mcfg.num_layers, mcfg.num_layers)
                    rows.append({"model": m, "hardware": "this-cpu", "link": t, "chunk_size": c, "context_len": n,
                                 "reread_bytes": reread_bytes(kv, n, c), "transfer_bytes": transfer_bytes(kv, n),
                                 "chunked_prefill_ms": chunked * 1e3, "whole_prefill_ms": whole * 1e3,
                                 "reread_ms": (chunked - whole) * 1e3, "transfer_ms": tr * 1e3,
                                 "exposed_transfer_ms": exposed * 1e3, "source": "real", "transport": t}
                                | piggy[(n, c)])
            log(f"  real {m} L={n}: whole {whole * 1e3:.0f} ms")
    return rows


def _measured_piggyback(cfg: RunConfig, model: str, contexts: list[int], log) -> dict[tuple[int, int], dict]:
    """{(L, C): {piggyback column: ms}} measured on the model executor: each
    chunk of an L prompt timed in a batch with B decodes at context
    decode_context_len, minus the same decodes alone, summed, minus the whole
    prefill alone (the least of `repeats` runs for every batch)."""
    from testbed.batch import Batch
    from testbed.experiments.prefill import RealBench
    e = cfg.experiment
    decode_ctx, most = e.decode_context_len, max(e.piggyback_decodes)
    bench = RealBench(model, max(contexts) + max(most, 1) * (decode_ctx + cfg.block_size), cfg.block_size, cfg.seed)
    running = bench.decodes(max(most, 1), decode_ctx)          # B decodes: the first B of these
    decodes = {b: running[:b] for b in sorted(set(e.piggyback_decodes))}
    bench.batch_s(Batch(running), 1)                           # warm-up
    base = {b: bench.batch_s(Batch(d), e.repeats) if d else 0.0 for b, d in decodes.items()}
    out: dict[tuple[int, int], dict] = {}
    for n in contexts:
        req = bench.request(n, 0)
        whole = bench.prefill_s(req, None, e.repeats)
        for c in e.real_chunk_sizes:
            row = {}
            for b, d in decodes.items():
                added = 0.0
                for start in range(0, n, c):
                    req.num_computed_tokens = start
                    added += bench.batch_s(Batch(d + [ScheduledSlice(req, min(c, n - start))]), e.repeats) - base[b]
                row[piggyback_column(b)] = (added - whole) * 1e3
            out[(n, c)] = row
        bench.bm.free(req.request_id)
        log(f"  real {model} L={n}: piggyback tax " + ", ".join(
            f"C={c} " + "/".join(f"{v:.0f}" for v in out[(n, c)].values()) + " ms" for c in e.real_chunk_sizes)
            + f" (B={'/'.join(map(str, decodes))})")
    return out


# -- L* ------------------------------------------------------------------------------------------------
def _summary(rows: list[dict], max_context: int, piggyback_decodes) -> list[dict]:
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        groups.setdefault((r["source"], r["model"], r["hardware"], r["link"], r["chunk_size"]), []).append(r)
    out = []
    for (source, model, hw, link, c), pts in sorted(groups.items()):
        pts.sort(key=lambda r: r["context_len"])
        entry = {"source": source, "model": model, "hardware": hw, "link": link, "chunk_size": c}
        lengths = [p["context_len"] for p in pts]
        if source == "sim" and link in LINK_PRESETS:
            hbm = load_hardware_preset(hw).hbm_bw_gbps * 1e9
            link_bw = load_link_preset(link).bytes_per_s
            kv = load_model_preset(model).kv_bytes_per_token
            entry["hbm_bytes_per_s"], entry["link_bytes_per_s"] = hbm, link_bw
            entry["L_star_bytes_closed_form"] = closed_form_crossover(c, hbm, link_bw)
            entry["L_star_bytes"] = crossover_by_bytes(kv, c, hbm, link_bw, max_context)
        pts_obj = [CrossoverPoint(**{k: p[k] for k in POINT_COLUMNS}) for p in pts]
        entry["L_star_time"] = crossover_by_time(pts_obj, "transfer_ms")
        entry["L_star_time_layerwise"] = crossover_by_time(pts_obj, "exposed_transfer_ms")
        for b in piggyback_decodes:
            taxes = [p[piggyback_column(b)] for p in pts]
            entry[f"L_star_piggyback_b{b}"] = crossover_by_time(pts_obj, "transfer_ms", taxes)
            entry[f"L_star_piggyback_b{b}_layerwise"] = crossover_by_time(pts_obj, "exposed_transfer_ms", taxes)
        entry["context_range"] = [lengths[0], lengths[-1]]
        out.append(entry)
    return out


def _series(rows: list[dict], key: str, fixed: dict) -> tuple[list[int], list[float]]:
    """(context lengths, values) of the rows matching `fixed`; zeros (no chunking
    when L <= C) are left out of the log-scale plots."""
    pts = sorted((r for r in rows if all(r[k] == v for k, v in fixed.items()) and r[key] > 0),
                 key=lambda r: r["context_len"])
    return [p["context_len"] for p in pts], [p[key] for p in pts]


def _plot(rows: list[dict], summary: list[dict], out: Path, piggyback_decodes) -> list[Path]:
    """One figure per model on its headline hardware (h100-sxm, else the first):
    left, bytes over bandwidth; right, time, with measured points where the
    real engine ran. Solid: re-read tax per chunk size (dash-dotted, C=512 only:
    the same chunks piggybacked on B decodes; positive values only, on the log
    scale); dashed:
    transfer tax per link; dotted: exposed transfer with layer-wise streaming."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    paths = []
    for model in sorted({r["model"] for r in rows}):
        mrows = [r for r in rows if r["model"] == model]
        sim = [r for r in mrows if r["source"] == "sim"]
        hws = [h for h in dict.fromkeys(r["hardware"] for r in sim)]
        hw = "h100-sxm" if "h100-sxm" in hws else (hws[0] if hws else "this-cpu")
        sim = [r for r in sim if r["hardware"] == hw]
        chunks = sorted({r["chunk_size"] for r in sim})
        links = list(dict.fromkeys(r["link"] for r in sim))
        by_bytes = bool(links) and links[0] in LINK_PRESETS
        fig, axes = plt.subplots(1, 2 if by_bytes else 1, figsize=(13 if by_bytes else 7, 5.5), squeeze=False)
        ax_b, ax_t = (axes[0][0], axes[0][1]) if by_bytes else (None, axes[0][0])
        colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
        if by_bytes:
            hbm = load_hardware_preset(hw).hbm_bw_gbps * 1e9
            for i, c in enumerate(chunks):
                x, y = _series(sim, "reread_bytes", {"chunk_size": c, "link": links[0]})
                ax_b.plot(x, [b / hbm * 1e3 for b in y], "-", color=colors[i % 10], label=f"re-read C={c}")
            for j, link in enumerate(links):
                bw = load_link_preset(link).bytes_per_s
                x, y = _series(sim, "transfer_bytes", {"chunk_size": chunks[0], "link": link})
                ax_b.plot(x, [b / bw * 1e3 for b in y], "--", color=colors[(j + 5) % 10], label=f"transfer {link}")
            ax_b.set_title(f"{model} on {hw}: bytes / bandwidth")
        for i, c in enumerate(chunks):
            x, y = _series(sim, "reread_ms", {"chunk_size": c, "link": links[0]})
            ax_t.plot(x, y, "-", color=colors[i % 10], label=f"re-read C={c} (sim)")
            if c != (512 if 512 in chunks else chunks[0]):
                continue
            riding = [b for b in piggyback_decodes if b > 0]
            for k, b in enumerate(riding):
                x, y = _series(sim, piggyback_column(b), {"chunk_size": c, "link": links[0]})
                ax_t.plot(x, y, "-.", lw=1.0, alpha=0.4 + 0.6 * (k + 1) / len(riding),
                          color=colors[i % 10], label=f"C={c} riding on {b} decodes (sim)")
        for j, link in enumerate(links):
            x, y = _series(sim, "transfer_ms", {"chunk_size": chunks[0], "link": link})
            ax_t.plot(x, y, "--", color=colors[(j + 5) % 10], label=f"transfer {link} (sim)")
            x, y = _series(sim, "exposed_transfer_ms", {"chunk_size": chunks[0], "link": link})
            ax_t.plot(x, y, ":", color=colors[(j + 5) % 10], label=f"exposed, layer-wise {link} (sim)")
        real = [r for r in mrows if r["source"] == "real"]
        for i, c in enumerate(sorted({r["chunk_size"] for r in real})):
            x, y = _series(real, "reread_ms", {"chunk_size": c, "link": real[0]["link"]})
            ax_t.plot(x, y, "o", color=colors[i % 10], label=f"re-read C={c} (measured)")
        for j, link in enumerate(dict.fromkeys(r["link"] for r in real)):
            x, y = _series(real, "transfer_ms", {"chunk_size": real[0]["chunk_size"], "link": link})
            ax_t.plot(x, y, "s", mfc="none", color=colors[(j + 5) % 10], label=f"transfer {link} (measured)")
        ax_t.set_title(f"{model}: time (" + ("measured on this CPU and " if real else "") + f"modeled on {hw})")
        for ax in axes[0]:
            ax.set_xscale("log", base=2)
            ax.set_yscale("log")
            ax.set_xlabel("context length L (tokens)")
            ax.set_ylabel("ms per prompt")
            ax.legend(fontsize=6, loc="upper left")
        path = out / f"crossover_{model}.png"
        save_figure(fig, path)
        paths.append(path)
    return paths


def run_crossover(cfg: RunConfig, out: Path, log=print) -> dict:
    e = cfg.experiment
    t0 = time.perf_counter()
    rows = _sim_rows(e.models, e.hardware, e.links, e.chunk_sizes, e.context_lens, e.piggyback_decodes,
                     e.decode_context_len, cfg.engine)
    log(f"simulated {len(rows)} points in {time.perf_counter() - t0:.1f} s")
    if e.real:
        cpu_contexts = [n for n in e.real_context_lens if n <= e.real_max_tokens]
        cpu_link = [LinkConfig(name=f"shaped-{g:g}g", bandwidth_gbps=g) for g in e.real_link_gbps]
        rows += _sim_rows(e.real_models, ["cpu"], cpu_link, e.real_chunk_sizes, cpu_contexts, e.piggyback_decodes,
                          e.decode_context_len)
        rows += _real_rows(cfg, log)
    with open(out / "crossover.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=columns(e.piggyback_decodes))
        w.writeheader()
        w.writerows(rows)
    summary = _summary(rows, max(e.context_lens), e.piggyback_decodes)
    (out / "crossover_summary.json").write_text(json.dumps(summary, indent=2))
    figures = _plot(rows, summary, out, e.piggyback_decodes)
    return {"experiment": "crossover", "num_points": len(rows), "summary": summary,
            "figures": [p.name for p in figures], "rows": rows,
            "series": _wandb_series(rows), "tables": {"lstar": summary}}


def _wandb_series(rows: list[dict]) -> list[dict]:
    """W&B line series (testbed/experiments/__init__.py), one per model, hardware
    and link of the simulated rows, so their number stays that of the grid's
    (model, hardware, link): the re-read tax at each chunk size, the piggyback
    tax at each decode count (C=512), and the transfer tax (whole, and exposed
    with layer-wise streaming) against L."""
    sim = [r for r in rows if r["source"] == "sim"]
    out = []
    for model, hw, link in dict.fromkeys((r["model"], r["hardware"], r["link"]) for r in sim):
        at = {(r["chunk_size"], r["context_len"]): r for r in sim
              if (r["model"], r["hardware"], r["link"]) == (model, hw, link)}
        xs = sorted({n for _, n in at})
        chunks = sorted({c for c, _ in at})
        keys, ys = [], []
        for c in chunks:
            keys.append(f"reread_ms C={c}")
            ys.append([at[(c, n)]["reread_ms"] if (c, n) in at else None for n in xs])
        riding = 512 if 512 in chunks else chunks[0]
        for column in sorted((k for k in sim[0] if k.startswith("piggyback_b")), key=lambda k: int(k[11:-3])):
            keys.append(f"{column} C={riding}")
            ys.append([at[(riding, n)][column] if (riding, n) in at else None for n in xs])
        for column in ("transfer_ms", "exposed_transfer_ms"):
            keys.append(column)
            ys.append([at[(chunks[0], n)][column] if (chunks[0], n) in at else None for n in xs])
        out.append({"key": f"crossover/taxes/{model}/{hw}/{link}", "xname": "context_len", "xs": xs, "ys": ys,
                    "keys": keys, "title": f"{model} on {hw} over {link}: chunk re-read vs transfer tax (ms)"})
    return out
