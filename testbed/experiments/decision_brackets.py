"""What the decision study already knows about a capacity search before it
probes, and how it probes less for the same answers (decision_grid.py runs
the sweeps, decision_search.py the searches). Three policies:

- **The neighbouring length.** A deployment's capacity at L/2 under one SLO
  definition and TBT target, times the cost model's ratio of one request's
  work at L/2 and at L (`work_s`), is a guess at its capacity at L under the
  same; the search probes a bracket of rel_tol around
  the guess first (search_rate's `bracket`) and ends in two probes where the
  guess holds, moving out geometrically where it does not. On another link
  the bracket that link found at L comes first (decision_search.length_rows'
  `seed`): the link rarely moves it.
- **The cell's best.** The deployments of one family sharing a sweep are
  searched at each L best first (by capacity at L/2: the likely winners
  before the rest). One expected below its family's best steady capacity so
  far in the same cell (model, hardware, link, N, SLO, L) is probed at that
  capacity first: failing there, its capacity lies below it (the search's own
  premise: above a failing rate every rate fails), so it can win neither the
  cell nor its family and its row says `dominated`, with no capacity and that
  rate as its bracket's top. The bound is a measured verdict at the same cell,
  not a model's estimate, so the skip never hides a winner the full search
  would have found. Passing there, its search goes on up from that rate.
- **The tolerance.** search_rate stops once its bracket is within rel_tol: a
  bracket from either policy above that holds ends the search in its two
  probes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.experiments.decision_search import Search
from testbed.experiments.decision_summary import DOMINATED
from testbed.experiments.deployments import Deployment

# the decode batch that prices a request's share of a decode iteration in `work_s`
WORK_BATCH = 64


def work_s(cost, L: int, output_len: int) -> float:
    """GPU seconds one request of L tokens costs a loaded worker: its whole
    prefill, then output_len decodes, each a 1/WORK_BATCH share of a full decode
    batch at context L. Capacity per request falls about as this grows (the
    prefill's linear then quadratic work, the decodes' KV reads)."""
    return cost.iteration_time_s([(L, L)]) + output_len * cost.iteration_time_s([(1, L)] * WORK_BATCH) / WORK_BATCH


@dataclass
class Known:
    """One deployment's searches so far in its sweep: the first search per L on
    the previous link (the next link's seeds) and on this one."""
    seeds: dict[int, Search] = field(default_factory=dict)       # the previous link's
    found: dict[int, Search] = field(default_factory=dict)       # this link's
    # this link's searches per L by (TBT target, SLO definition)
    searches: dict[int, dict[tuple, Search]] = field(default_factory=dict)

    def capacity(self, L: int) -> float | None:
        """Its capacity at L on this link (req/s), None where it has none or was dominated."""
        s = self.found.get(L)
        return s.capacity if s is not None else None

    def rank(self, L: int | None, position: int) -> tuple:
        """Its place in a best-first order at the length after L: by capacity at L, then the
        dominated there by the rate they failed at, then the rest (the first L: the grid's order)."""
        s = self.found.get(L) if L is not None else None
        if s is not None and s.capacity is not None:
            return (0, -s.capacity, position)
        if s is not None and s.limited_by == DOMINATED:
            return (1, -s.first_failing, position)
        return (2, 0.0, position)

    def next_link(self) -> None:
        self.seeds = {L: s for L, s in self.found.items()
                      if s.capacity and s.first_failing and s.first_failing <= 2 * s.capacity}
        self.found, self.searches = {}, {}


def neighbour_brackets(known: Known, L: int, previous: int | None, work: dict[int, float],
                       rel_tol: float) -> dict[tuple, tuple[float, float]]:
    """Per (TBT target, SLO definition): the bracket of width rel_tol (req/s)
    centred on that search's capacity at `previous` (the grid's length below
    L) scaled by work[previous] / work[L]; none where it had no capacity there
    (a dominated deployment's failing rate is no guess: its search starts at
    the cell's best)."""
    half = (1 + rel_tol) ** 0.5
    out = {}
    for which, s in known.searches.get(previous, {}).items():
        if s.capacity:
            guess = s.capacity * work[previous] / work[L]
            out[which] = (guess / half, guess * half)
    return out


def best_first(deps: list[Deployment], known: dict[str, Known], previous: int | None) -> list[Deployment]:
    """The likely winners first: by capacity at the previous length (Known.rank)."""
    return [deps[i] for i in sorted(range(len(deps)), key=lambda i: known[deps[i].label].rank(previous, i))]


class CellBest:
    """The best steady capacity per GPU of each SLO definition and TBT target
    among a family's rows so far at one L and link: the rate a later
    deployment must pass to stay in the running."""

    def __init__(self) -> None:
        self.best: dict[tuple, float] = {}

    def add(self, rows: list[dict]) -> None:
        for r in rows:
            cap = r["capacity_per_gpu"]
            if cap is not None and r["steady"]:
                key = (r["tbt_slo_ms"], r["slo"])
                self.best[key] = max(cap, self.best.get(key, 0.0))

    def ceilings(self) -> dict[tuple, float]:
        """(TBT target, SLO definition) -> capacity per GPU to beat."""
        return dict(self.best)
