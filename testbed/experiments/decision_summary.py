"""decision.csv's rows -> decision_summary.json: per model, hardware, link,
GPU count and SLO, the best colocated and the best disaggregated deployment
at each context length L and the system crossover L*, the smallest L of the
grid from which on the best disaggregated capacity per GPU exceeds the best
colocated one at every larger L (null when it never does).

Only steady rows count (steady_state.py). A family with no steady capacity at
an L counts as 0 there; an L where neither family has one has no winner and
neither starts nor breaks the run of L's that makes L*. `ties` lists the L's
where the two families' best capacities are within the search's brackets of
each other (`within_bracket`): the winner there is not resolved."""
from __future__ import annotations

import math
from collections import defaultdict
from typing import Iterable

GROUP_KEYS = ("model", "hardware", "link", "link_gbps", "num_gpus", "slo", "tbt_slo_ms")
# a row whose deployment failed at a rate its family's best passed in the same cell (decision_brackets.py):
# no capacity, that rate its bracket's top; it counts for no winner, as a row without a capacity
DOMINATED = "dominated"


def _capacity(row: dict) -> float | None:
    cap = row.get("capacity_per_gpu")
    return float(cap) if cap not in (None, "") and _truthy(row.get("steady")) else None


def _truthy(v) -> bool:
    return v is True or str(v).lower() == "true"


def best_by_family(rows: Iterable[dict], family: str) -> dict[int, tuple[str, float]]:
    """L -> (label, capacity per GPU) of the family's best steady deployment."""
    best: dict[int, tuple[str, float]] = {}
    for r in rows:
        cap = _capacity(r)
        if r["family"] == family and cap is not None:
            L = int(r["context_len"])
            if L not in best or cap > best[L][1]:
                best[L] = (r["deployment"], cap)
    return best


def bracket_top(row: dict) -> float | None:
    """The first failing rate per GPU of a row's search: its capacity lies in
    [capacity_per_gpu, this). Infinite where the search never failed above it;
    None for a row from before the column (it cannot say)."""
    if "first_failing_per_gpu" not in row:
        return None
    fail = row["first_failing_per_gpu"]
    return float(fail) if fail not in (None, "") else math.inf


def within_bracket(winner: dict, rivals: Iterable[dict]) -> bool:
    """Whether a rival's steady capacity may exceed the winner's: a search
    brackets a capacity to [capacity, first failing rate), and the verdict at a
    rate near capacity moves with the probe's length (~one 10% step), so a
    rival whose bracket reaches above the winner's capacity is a tie, not a
    loss."""
    cap = _capacity(winner)
    # a rival that failed at the very rate the winner passed (the searches share their grid of rates, up to
    # rounding) is beaten there, not tied
    return cap is not None and any(_capacity(r) is not None and (bracket_top(r) or 0.0) > cap * (1 + 1e-9)
                                   for r in rivals)


def ties(rows: Iterable[dict]) -> list[int]:
    """The L's where the best colocated and the best disaggregated deployment
    are within each other's bracket (`within_bracket`): there the winner, and
    an L* starting there, is inside the search's resolution."""
    by_length: dict[int, list[dict]] = defaultdict(list)
    for r in rows:
        if r["family"] in ("colocated", "disaggregated") and _capacity(r) is not None:
            by_length[int(r["context_len"])].append(r)
    out = []
    for L, rs in sorted(by_length.items()):
        best = max(rs, key=_capacity)
        if within_bracket(best, [r for r in rs if r["family"] != best["family"]]):
            out.append(L)
    return out


def l_star(lengths: list[int], colocated: dict[int, float], disaggregated: dict[int, float]) -> int | None:
    """The smallest L of `lengths` from which on disaggregated > colocated at every
    L that has a capacity on either side (missing capacities count as 0)."""
    answer = None
    for L in sorted(lengths, reverse=True):
        c, d = colocated.get(L), disaggregated.get(L)
        if c is None and d is None:
            continue
        if (d or 0.0) > (c or 0.0):
            answer = L
        else:
            break
    return answer


def winners(rows: Iterable[dict]) -> set[str]:
    """The labels of the highest steady capacity per GPU among rows (one L;
    several when tied), empty when none is steady."""
    caps = {r["deployment"]: _capacity(r) for r in rows if _capacity(r) is not None}
    best = max(caps.values(), default=None)
    return {label for label, cap in caps.items() if cap >= best * (1 - 1e-9)} if caps else set()


def crossovers(rows: list[dict]) -> list[dict]:
    groups: dict[tuple, list[dict]] = defaultdict(list)
    for r in rows:
        groups[tuple(r[k] for k in GROUP_KEYS)].append(r)
    out = []
    for key, grows in groups.items():
        lengths = sorted({int(r["context_len"]) for r in grows})
        col, dis = best_by_family(grows, "colocated"), best_by_family(grows, "disaggregated")
        entry = dict(zip(GROUP_KEYS, key))
        entry.update(
            link_gbps=float(entry["link_gbps"]), num_gpus=int(entry["num_gpus"]),
            l_star=l_star(lengths, {L: c for L, (_, c) in col.items()}, {L: c for L, (_, c) in dis.items()}),
            best_colocated={str(L): col[L][0] for L in lengths if L in col},
            best_disaggregated={str(L): dis[L][0] for L in lengths if L in dis},
            ties=ties(grows),
            best_colocated_capacity={str(L): col[L][1] for L in lengths if L in col},
            best_disaggregated_capacity={str(L): dis[L][1] for L in lengths if L in dis})
        out.append(entry)
    return out


def definition_changes(rows: list[dict]) -> list[dict]:
    """Where the winner (the best steady deployment; ties count as either)
    differs between the smoothness definitions at the same model, hardware,
    link, N, TBT and L (a cell where one definition has no steady winner
    says nothing)."""
    cells: dict[tuple, dict[str, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for r in rows:
        cell = tuple(r[k] for k in ("model", "hardware", "link", "num_gpus", "tbt_slo_ms", "context_len"))
        cells[cell][r["slo"]].append(r)
    out = []
    for cell, by_slo in cells.items():
        best = {slo: winners(rs) for slo, rs in by_slo.items()}
        if len(best) > 1 and all(best.values()) and not set.intersection(*best.values()):
            out.append({**dict(zip(("model", "hardware", "link", "num_gpus", "tbt_slo_ms", "context_len"), cell)),
                        "winners": {slo: sorted(labels) for slo, labels in best.items()}})
    return out


MATCH_KEYS = ("model", "hardware", "link", "num_gpus", "slo", "tbt_slo_ms", "deployment", "context_len")


def sim_vs_real(rows: list[dict]) -> list[dict]:
    """Each measured row (source=real) beside the simulator's row of the same
    MATCH_KEYS: both capacities per GPU, whether each was steady, what
    limited each, and real / sim where both are steady capacities (None
    otherwise). A measured row without a simulated twin has sim None."""
    def key(r: dict) -> tuple:
        return tuple(str(r[k]) for k in MATCH_KEYS)
    sim = {key(r): r for r in rows if (r.get("source") or "sim") == "sim"}
    out = []
    for r in rows:
        if r.get("source") != "real":
            continue
        s = sim.get(key(r), {})
        real_cap, sim_cap = _capacity(r), _capacity(s) if s else None
        fail = r.get("first_failing_per_gpu")
        real_fail = float(fail) if fail not in (None, "") else None
        out.append({**{k: r[k] for k in MATCH_KEYS}, "has_sim": bool(s),
                    "sim_capacity_per_gpu": s.get("capacity_per_gpu"), "real_capacity_per_gpu": r["capacity_per_gpu"],
                    "sim_steady": _truthy(s.get("steady")), "real_steady": _truthy(r.get("steady")),
                    "sim_limited_by": s.get("limited_by"), "real_limited_by": r.get("limited_by"),
                    "real_over_sim": real_cap / sim_cap if real_cap is not None and sim_cap else None,
                    # the real search's bracket over the simulator's capacity: real/sim lies in
                    # [real_over_sim, real_over_sim_upper) (None where the real search never failed)
                    "real_over_sim_upper": real_fail / sim_cap if real_cap is not None and sim_cap
                    and real_fail is not None else None})
    return out
