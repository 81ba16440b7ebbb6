"""`testbed report`'s per-run figure: every inter-token gap at the time its
token arrived (TTFTs marked), above the tokens of each iteration split into
prefill and decode, which is where a prefill stall shows.

It stays readable at 10^5 iterations: up to MAX_BARS iterations are drawn as
one bar each; beyond that, bars of a few pixels merge into black, so the
iterations are binned into NUM_BINS time buckets and drawn as filled steps
(the mean prefill and decode tokens per iteration in each bucket, no edges)
with the bucket's largest iteration as a line, so a stall still shows."""
from __future__ import annotations

from pathlib import Path

import numpy as np

from testbed.experiments.decision_figures import wrap_title
from testbed.metrics import IterationRecord

MAX_BARS = 400
NUM_BINS = 500
_MAX_POINTS = 20_000        # scatter points above this are rasterized: a vector PNG layer of 10^6 dots is slow


def binned_iterations(iterations: list[IterationRecord], t0: float, num_bins: int = NUM_BINS):
    """(bin edges, mean decode, mean prefill, max total tokens per iteration) over
    equal time buckets of the iterations' start times; empty buckets give 0."""
    start = np.array([it.start_s - t0 for it in iterations])
    decode = np.array([it.num_decode_tokens for it in iterations], dtype=float)
    prefill = np.array([it.num_prefill_tokens for it in iterations], dtype=float)
    end = max(float(start.max()), float(start.min()) + 1e-9)
    edges = np.linspace(float(start.min()), end, num_bins + 1)
    idx = np.clip(np.searchsorted(edges, start, side="right") - 1, 0, num_bins - 1)
    count = np.bincount(idx, minlength=num_bins)
    safe = np.maximum(count, 1)
    mean_decode = np.bincount(idx, decode, minlength=num_bins) / safe
    mean_prefill = np.bincount(idx, prefill, minlength=num_bins) / safe
    peak = np.zeros(num_bins)
    np.maximum.at(peak, idx, decode + prefill)
    return edges, mean_decode, mean_prefill, peak


def _iterations_panel(ax, iterations: list[IterationRecord], t0: float) -> None:
    if len(iterations) <= MAX_BARS:
        starts = [it.start_s - t0 for it in iterations]
        widths = [it.duration_s for it in iterations]
        decode = [it.num_decode_tokens for it in iterations]
        ax.bar(starts, decode, width=widths, align="edge", color="tab:green", edgecolor="black", linewidth=0.3,
               label="decode tokens")
        ax.bar(starts, [it.num_prefill_tokens for it in iterations], bottom=decode, width=widths, align="edge",
               color="tab:orange", edgecolor="black", linewidth=0.3, label="prefill tokens")
        return
    edges, decode, prefill, peak = binned_iterations(iterations, t0)
    width = edges[1] - edges[0]
    step = lambda v: np.append(v, v[-1])  # noqa: E731  (fill_between's step="post" wants one value per edge)
    ax.fill_between(edges, 0, step(decode), step="post", color="tab:green", linewidth=0,
                    label=f"decode tokens (mean per iteration, {width * 1e3:.3g} ms buckets)")
    ax.fill_between(edges, step(decode), step(decode + prefill), step="post", color="tab:orange", linewidth=0,
                    label="prefill tokens (mean)")
    ax.step(edges, step(peak), where="post", color="black", linewidth=0.5, label="largest iteration in bucket")


def plot_tbt(run, path: Path) -> None:
    """run: a report.Run (label, requests, iterations)."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    requests = [r for r in run.requests if r.token_times_s]
    iterations = run.iterations or []
    t0 = min([r.arrival_s for r in run.requests] + [it.start_s for it in iterations], default=0.0)
    fig, (ax_tbt, ax_it) = plt.subplots(2, 1, sharex=True, figsize=(10, 6), height_ratios=[3, 1])
    gap_t = [t - t0 for r in requests for t in r.token_times_s[1:]]
    # gaps of 0 (tokens delivered in one message) would vanish on a log axis
    gap_ms = [max(g * 1000, 1e-3) for r in requests for g in r.tbt_s]
    ax_tbt.scatter(gap_t, gap_ms, s=4, alpha=0.5, label="TBT (every inter-token gap)",
                   rasterized=len(gap_t) > _MAX_POINTS)
    ax_tbt.scatter([r.token_times_s[0] - t0 for r in requests], [r.ttft_s * 1000 for r in requests],
                   s=16, marker="x", color="tab:red", label="TTFT (at first token)")
    ax_tbt.set_ylabel("ms")
    if requests:
        ax_tbt.set_yscale("log")
    else:       # (a run interrupted before any token: a log axis of nothing cannot be drawn)
        ax_tbt.text(0.5, 0.5, "no token reached the client in this run", transform=ax_tbt.transAxes,
                    ha="center", va="center")
    fig.suptitle(wrap_title(run.label, 90), fontsize="medium")
    # legends sit above the axes: a stall's few points are often in a corner
    ax_tbt.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=2, fontsize="small", frameon=False)
    if iterations:
        _iterations_panel(ax_it, iterations, t0)
        ax_it.legend(loc="lower left", bbox_to_anchor=(0, 1.0), ncol=3, fontsize="x-small", frameon=False)
    ax_it.set_ylabel("tokens/iter")
    ax_it.set_xlabel("time since first arrival (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
