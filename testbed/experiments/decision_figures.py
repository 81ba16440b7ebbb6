"""The decision study's figures, from decision.csv-shaped rows (one dict per
capacity point): capacity per GPU against context length L, one line per
deployment, and the phase diagram over (L, link bandwidth) colored by the
family of the deployment that serves the most requests per GPU, with the
system L* drawn as the boundary. `testbed report SWEEP_DIR` draws the first
from a sweep of ordinary runs (testbed/report_sweep.py).

Matplotlib is imported inside the plotting functions so that `winners`, the
tested heart of the phase diagram, needs none."""
from __future__ import annotations

import math
import textwrap
from pathlib import Path

from testbed.experiments.decision_summary import DOMINATED

FAMILIES = ("colocated", "disaggregated", "hybrid")
FAMILY_COLORS = {"colocated": "tab:blue", "disaggregated": "tab:orange", "hybrid": "tab:green"}
NO_WINNER_COLOR = "0.85"
_TITLE_WIDTH = 70


def fmt_tokens(n: float) -> str:
    """1024 -> '1K', 1536 -> '1.5K', 1048576 -> '1M', 512 -> '512'."""
    for unit, size in (("M", 1 << 20), ("K", 1 << 10)):
        if n >= size:
            return f"{n / size:g}{unit}"
    return f"{n:g}"


def wrap_title(title: str, width: int = _TITLE_WIDTH) -> str:
    return "\n".join(textwrap.wrap(title, width)) or title


def _capacity(row: dict) -> float | None:
    value = row.get("capacity_per_gpu")
    if value in (None, ""):
        return None
    value = float(value)
    return None if math.isnan(value) else value


def _steady(row: dict) -> bool:
    value = row.get("steady", True)
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


def _dominated(row: dict) -> bool:
    return row.get("limited_by") == DOMINATED and row.get("first_failing_per_gpu") not in (None, "")


def winners(rows: list[dict]) -> dict[tuple[int, float], dict]:
    """(context_len, link_gbps) -> the row of the deployment with the highest
    steady capacity_per_gpu in that cell. Unsteady rows and rows without a
    capacity are not counted; a cell with none of them has no winner (absent).
    Ties keep the first row given."""
    best: dict[tuple[int, float], dict] = {}
    for r in rows:
        cap = _capacity(r)
        if cap is None or not _steady(r):
            continue
        cell = (int(r["context_len"]), float(r["link_gbps"]))
        if cell not in best or cap > _capacity(best[cell]):
            best[cell] = r
    return best


def _log2_tokens_axis(ax, lengths: list[int]) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator
    ax.set_xscale("log", base=2)
    ax.xaxis.set_major_locator(FixedLocator(sorted(set(lengths))))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.xaxis.set_major_formatter(FuncFormatter(lambda x, _: fmt_tokens(x)))
    ax.set_xlabel("context length L (tokens)")


def plot_capacity_vs_length(rows: list[dict], path: Path, title: str,
                            ylabel: str = "capacity per GPU (req/s)") -> Path:
    """Capacity per GPU against L, one line per deployment (points without a
    capacity leave a gap). Measured points (source `real`) are squares on a
    dashed line of their own; points whose probes never reached steady state
    are hollow; a deployment skipped as dominated (decision_brackets.py) is a
    small triangle at the rate it failed: its capacity lies below."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from testbed.experiments import save_figure
    fig, ax = plt.subplots(figsize=(10, 5.5))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    deployments = list(dict.fromkeys(r["deployment"] for r in rows))
    for i, dep in enumerate(deployments):
        color = colors[i % len(colors)]
        for source, marker, style in (("sim", "o", "-"), ("real", "s", "--")):
            pts = sorted((r for r in rows if r["deployment"] == dep and (r.get("source") or "sim") == source),
                         key=lambda r: int(r["context_len"]))
            if not pts:
                continue
            caps = [_capacity(r) for r in pts]
            xs = [int(r["context_len"]) for r in pts]
            label = dep if source == "sim" else f"{dep} (measured)"
            ax.plot(xs, [math.nan if c is None or c <= 0 else c for c in caps], style, color=color, label=label)
            for steady, face in ((True, color), (False, "none")):
                sel = [(x, c) for x, c, r in zip(xs, caps, pts) if c and c > 0 and _steady(r) == steady]
                if sel:
                    ax.scatter(*zip(*sel), marker=marker, s=28, facecolors=face, edgecolors=color, zorder=3)
            below = [(x, float(r["first_failing_per_gpu"])) for x, r in zip(xs, pts) if _dominated(r)]
            if below:
                ax.scatter(*zip(*below), marker="v", s=14, color=color, zorder=3)
    if any(_dominated(r) for r in rows):
        ax.scatter([], [], marker="v", s=14, color="black", label="dominated: below the best in the cell (not searched)")
    if any(not _steady(r) and not _dominated(r) for r in rows):
        ax.scatter([], [], marker="o", facecolors="none", edgecolors="black", label="not steady (not counted)")
    _log2_tokens_axis(ax, [int(r["context_len"]) for r in rows])
    if any((_capacity(r) or 0) > 0 for r in rows):
        ax.set_yscale("log")
    ax.set_ylabel(ylabel)
    ax.grid(True, which="major", alpha=0.3)
    ax.set_title(wrap_title(title), fontsize="medium")
    ax.legend(loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return save_figure(fig, path)


def tied_cells(rows: list[dict], best: dict[tuple[int, float], dict] | None = None) -> set[tuple[int, float]]:
    """The cells of `winners` (`best`, when the caller has it) whose winner a
    deployment of another family may beat: that one's search bracket reaches
    above the winner's capacity (decision_summary.within_bracket). The phase
    diagram hatches them."""
    from testbed.experiments.decision_summary import within_bracket
    by_cell: dict[tuple[int, float], list[dict]] = {}
    for r in rows:
        by_cell.setdefault((int(r["context_len"]), float(r["link_gbps"])), []).append(r)
    return {cell for cell, r in (winners(rows) if best is None else best).items()
            if within_bracket(r, [o for o in by_cell[cell] if o["family"] != r["family"]])}


def cell_label(deployment: str) -> str:
    """A deployment's label in a phase-diagram cell, one short part a line, so
    that the longest fits its cell: "disagg-6P1D-p_tp1-d_tp2" is the three lines
    disagg / 6P1D / tp 1/2 (prefill pool's tp / decode pool's); "sarathi-512"
    is sarathi / 512."""
    parts = deployment.split("-")
    tp = [p[len("p_tp"):] for p in parts if p.startswith("p_tp")] + [p[len("d_tp"):] for p in parts
                                                                        if p.startswith("d_tp")]
    lines = [p for p in parts if not p.startswith(("p_tp", "d_tp"))]
    return "\n".join(lines + ([f"tp {'/'.join(tp)}"] if tp else []))


def plot_phase_diagram(rows: list[dict], path: Path, title: str,
                       l_star_by_link: dict[float, int | None]) -> Path:
    """Cells (L, link bandwidth) colored by the winning family (`winners`;
    grey: no steady capacity; hatched: a tie within the searches' brackets,
    `tied_cells`), each labeled by the winning deployment, and
    the L* boundary: in each link's row, a line at the left edge of the L*
    cell (disaggregation wins from there on); a row whose L* is None (not in
    range) gets no boundary segment."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch, Rectangle

    from testbed.experiments import save_figure
    lengths = sorted({int(r["context_len"]) for r in rows})
    links = sorted({float(r["link_gbps"]) for r in rows} | {float(g) for g in l_star_by_link})
    link_names = {float(r["link_gbps"]): r.get("link", "") for r in rows}
    best = winners(rows)
    codes = np.full((len(links), len(lengths)), np.nan)
    for (n, gbps), r in best.items():
        codes[links.index(gbps), lengths.index(n)] = FAMILIES.index(r["family"])
    # cell edges halfway (geometric) between grid lengths; rows are equally spaced link indices
    x_edges = _geometric_edges(lengths)
    y_edges = np.arange(len(links) + 1) - 0.5
    fig, ax = plt.subplots(figsize=(max(8, 0.7 * len(lengths) + 4), max(3.5, 0.6 * len(links) + 2)))
    cmap = ListedColormap([FAMILY_COLORS[f] for f in FAMILIES]).with_extremes(bad=NO_WINNER_COLOR)
    ax.pcolormesh(x_edges, y_edges, np.ma.masked_invalid(codes), cmap=cmap, vmin=-0.5, vmax=len(FAMILIES) - 0.5,
                  edgecolors="white", linewidth=0.5)
    tied = tied_cells(rows, best)
    for n, gbps in tied:
        i, j = links.index(gbps), lengths.index(n)
        ax.add_patch(Rectangle((x_edges[j], y_edges[i]), x_edges[j + 1] - x_edges[j], 1.0, fill=False,
                               hatch="///", edgecolor="white", linewidth=0, label="_tie"))
    for (n, gbps), r in best.items():
        ax.text(n, links.index(gbps), cell_label(str(r["deployment"])), ha="center", va="center",
                fontsize=5.5, color="black", linespacing=1.0)
    xs, ys = _boundary(lengths, x_edges, links, l_star_by_link)
    ax.plot(xs, ys, color="black", linewidth=2.5, label="L*: best disaggregated > best colocated from here on")
    _log2_tokens_axis(ax, lengths)
    ax.set_xlim(x_edges[0], x_edges[-1])
    ax.set_yticks(range(len(links)))
    ax.set_yticklabels([f"{link_names.get(g) or ''} {g:g} Gb/s".strip() for g in links])
    ax.set_ylabel("link bandwidth")
    ax.set_title(wrap_title(title), fontsize="medium")
    handles = [Patch(color=FAMILY_COLORS[f], label=f"{f} wins") for f in FAMILIES
               if any(r["family"] == f for r in best.values())]
    handles += [Patch(color=NO_WINNER_COLOR, label="no steady capacity")] if np.isnan(codes).any() else []
    handles += [Patch(facecolor="0.6", hatch="///", edgecolor="white",
                      label="a tie: another family's bracket reaches above")] if tied else []
    handles += ax.get_legend_handles_labels()[0]
    ax.legend(handles=handles, loc="upper left", bbox_to_anchor=(1.01, 1.0), fontsize="small", frameon=False)
    return save_figure(fig, path)


def _geometric_edges(lengths: list[int]) -> list[float]:
    if len(lengths) == 1:
        return [lengths[0] / math.sqrt(2), lengths[0] * math.sqrt(2)]
    mids = [math.sqrt(a * b) for a, b in zip(lengths, lengths[1:])]
    return [lengths[0] ** 2 / mids[0]] + mids + [lengths[-1] ** 2 / mids[-1]]


def _boundary(lengths, x_edges, links, l_star_by_link) -> tuple[list[float], list[float]]:
    """A step line through each link row's L* cell edge; NaN breaks it where
    a row has no L* (or an L* off the grid)."""
    xs, ys = [], []
    for i, gbps in enumerate(links):
        l_star = l_star_by_link.get(gbps)
        if l_star is None or int(l_star) not in lengths:
            xs.append(math.nan)
            ys.append(math.nan)
            continue
        x = x_edges[lengths.index(int(l_star))]
        xs += [x, x]
        ys += [i - 0.5, i + 0.5]
    return xs, ys


# -- from decision.csv and decision_summary.json, every figure and W&B series at once ----------------------
def _slice_key(r: dict) -> tuple:
    return (r["model"], r["hardware"], int(r["num_gpus"]), r["slo"], int(float(r["tbt_slo_ms"])))


def capacity_series(rows: list[dict]) -> list[dict]:
    """W&B line series (testbed/experiments/__init__.py), one per model,
    hardware, link, GPU count and SLO: capacity per GPU against L, one line per
    deployment (None where nothing passed or the probe was not steady)."""
    out = []
    for key in dict.fromkeys(_slice_key(r) + (r["link"],) for r in rows if (r.get("source") or "sim") == "sim"):
        pts = [r for r in rows if _slice_key(r) + (r["link"],) == key and (r.get("source") or "sim") == "sim"]
        xs = sorted({int(r["context_len"]) for r in pts})
        deployments = list(dict.fromkeys(r["deployment"] for r in pts))
        at = {(r["deployment"], int(r["context_len"])): r for r in pts}
        ys = [[_capacity(at[(d, n)]) if (d, n) in at and _steady(at[(d, n)]) else None for n in xs]
              for d in deployments]
        model, hw, gpus, slo, tbt, link = key
        out.append({"key": f"decision/capacity/{model}/{hw}/{link}/{gpus}gpu/{slo}-{tbt}ms", "xname": "context_len",
                    "xs": xs, "ys": ys, "keys": deployments,
                    "title": f"{model} on {hw} over {link}, {gpus} GPUs, {slo} {tbt} ms: capacity per GPU (req/s)"})
    return out


def decision_figures(rows: list[dict], crossovers: list[dict], out: Path) -> list[Path]:
    """For each model, hardware, GPU count and SLO of the simulated rows: a
    phase diagram (L* per link from decision_summary.json's `crossovers`) and
    one capacity-vs-L figure per link, with the real engine's rows of the same
    model, hardware, GPU count, SLO and link beside them where they exist."""
    paths = []
    sim = [r for r in rows if (r.get("source") or "sim") == "sim"]
    real = [r for r in rows if r.get("source") == "real"]
    for key in dict.fromkeys(_slice_key(r) for r in sim):
        model, hw, gpus, slo, tbt = key
        pts = [r for r in sim if _slice_key(r) == key]
        l_star = {float(c["link_gbps"]): c["l_star"] for c in crossovers
                  if (c["model"], c["hardware"], int(c["num_gpus"]), c["slo"], int(c["tbt_slo_ms"])) == key}
        stem = f"{model}_{hw}_{gpus}gpu_{slo}_{tbt}ms"
        paths.append(plot_phase_diagram(pts, out / f"phase_{stem}.png",
                                        f"{model} on {hw}, {gpus} GPUs, {slo} {tbt} ms: the winning family "
                                        f"per context length and link", l_star))
        for link in dict.fromkeys(r["link"] for r in pts):
            measured = [r for r in real if _slice_key(r) == key and r["link"] == link]
            paths.append(plot_capacity_vs_length(
                [r for r in pts if r["link"] == link] + measured, out / f"capacity_{stem}_{link}.png",
                f"capacity per GPU against L: {model} on {hw} over {link}, {gpus} GPUs, {slo} {tbt} ms"
                + (" (squares: measured on this CPU)" if measured else "")))
    return paths
