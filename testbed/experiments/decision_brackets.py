"""What the decision study already knows about a capacity search before it
probes, and how it probes less for the same answers (decision_grid.py runs
the sweeps, decision_search.py the searches). Four policies:

- **The neighbouring length.** A deployment's capacity at L/2 under one SLO
  definition and TBT target, times the cost model's ratio of one request's
  work at L/2 and at L (`work_s`), is a guess at its capacity at L under the
  same; the search probes a bracket of rel_tol around
  the guess first (search_rate's `bracket`) and ends in two probes where the
  guess holds, moving out geometrically where it does not (dominated at
  L/2, and its probe at the cell's best inconclusive: the bracket just below
  the rate it failed at, scaled alike). On another link
  the bracket that link found at L comes first (decision_search.length_rows'
  `seed`): the link rarely moves it.
- **The cell's best.** The deployments of one family sharing a sweep are
  searched at each L best first (by capacity at L/2: the likely winners
  before the rest). One expected below the best steady capacity so far in
  the same cell (model, hardware, link, N, SLO, L), a capacity whose probe
  judged at least MIN_JUDGED_TO_SKIP requests, first probes the top of its
  own bracket where that lies below the best, else the best, over as many
  judged requests: failing there, its capacity lies below that rate (the
  search's own premise: above a failing rate every rate fails), so it
  cannot win the cell and its row says `dominated`, with no capacity and
  that rate as its bracket's top. The bound is a verdict measured in the
  same cell over as long a probe as the best's own, not a model's estimate,
  so the skip hides no winner the full search would find. Passing there,
  it probes one rel_tol above next. The best is the family's own; with
  experiment.sweep_by=cell, where every deployment of a model, hardware and
  N shares one sweep, either family's: at each L the family that won more
  of L/2's cells goes first, and the other is probed against its best (a
  colocated row, standing under every link, against the link-using
  family's lowest best over the links).
- **The runs already made.** A deployment's searches at one L (one per TBT
  target and SLO definition) run on the same probes where the run does not
  read the SLO; each later one judges the runs made so far and, where they
  hold a steady pass and a failure above it within two bisections of
  rel_tol, starts from those two instead of its guess
  (decision_search.known_bracket): the searches differ only where their
  verdicts do.
- **The tolerance.** search_rate stops once its bracket is within rel_tol: a
  bracket from any policy above that holds ends the search in its two
  probes.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.experiments.decision_search import MIN_JUDGED_TO_SKIP, Search
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
    """One deployment's searches so far on one link of its sweep: the first
    search per L (the next link's seeds, `seed_of`) and every search per L."""
    found: dict[int, Search] = field(default_factory=dict)
    # the searches per L by (TBT target, SLO definition)
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


def seed_of(s: Search | None) -> Search | None:
    """A search on the previous link that seeds the same search on the next: one whose bracket
    [capacity, first failing rate) is at most 2x wide."""
    return s if s is not None and s.capacity and s.first_failing and s.first_failing <= 2 * s.capacity else None


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


def below_dominated(known: Known, L: int, previous: int | None, work: dict[int, float],
                    rel_tol: float) -> dict[tuple, tuple[float, float]]:
    """Per (TBT target, SLO definition) dominated at `previous`: the bracket of
    width rel_tol just below the rate it failed at, scaled by work[previous] /
    work[L] (its capacity lay below that rate, and near it: it was probed there
    for being expected close). An upper bound, not a guess of where it lies:
    a search's bracket only where it has no other (its top, where below the
    cell's best, is then the rate that may rule it out: decision_search)."""
    out = {}
    for which, s in known.searches.get(previous, {}).items():
        if s.capacity is None and s.limited_by == DOMINATED and s.first_failing:
            top = s.first_failing * work[previous] / work[L]
            out[which] = (top / (1 + rel_tol), top)
    return out


def best_first(deps: list[Deployment], known: dict[str, Known], previous: int | None) -> list[Deployment]:
    """The likely winners first: by capacity at the previous length (Known.rank)."""
    return [deps[i] for i in sorted(range(len(deps)), key=lambda i: known[deps[i].label].rank(previous, i))]


class CellBest:
    """The best steady capacity per GPU so far at one L, per (TBT target, SLO
    definition), of the colocated deployments (under any link) and of the
    link-using ones on each link: the rate a later deployment must pass to
    stay in the running. Within its family always; across the families only
    where they share a sweep (experiment.sweep_by=cell)."""

    def __init__(self, num_links: int) -> None:
        self.num_links = num_links
        self.best: dict[tuple, float] = {}            # (uses link, link index, TBT target, SLO) -> per GPU
        self.steady: dict[tuple, float] = {}          # the same over every steady capacity (the order)

    def add(self, dep: Deployment, link: int, rows: list[dict], searches: dict[tuple, Search]) -> None:
        """`rows` of `dep` at this L on `link`, `searches` its searches by (TBT target, SLO
        definition). A capacity counts where its probe was steady and judged at least
        MIN_JUDGED_TO_SKIP requests: a rival is ruled out only by as long a probe as its own
        failing one (a short probe's pass is the false answer that tail latency gives)."""
        for r in rows:
            cap, s = r["capacity_per_gpu"], searches.get((r["tbt_slo_ms"], r["slo"]))
            if cap is None or not r["steady"]:
                continue
            key = (dep.uses_link, link if dep.uses_link else 0, r["tbt_slo_ms"], r["slo"])
            self.steady[key] = max(cap, self.steady.get(key, 0.0))
            if s is not None and (s.judged or 0) >= MIN_JUDGED_TO_SKIP:
                self.best[key] = max(cap, self.best.get(key, 0.0))

    def _links(self, uses_link: bool) -> range:
        return range(self.num_links) if uses_link else range(1)

    def ceilings(self, dep: Deployment, link: int) -> dict[tuple, float]:
        """(TBT target, SLO definition) -> capacity per GPU to beat: the family's best so far (on
        this link), or the other family's where higher. A colocated row stands under every link,
        so the link-using family's rate for it is its lowest over the links, where every link
        has one."""
        out: dict[tuple, float] = {}
        for which in {(tbt, slo) for _, _, tbt, slo in self.best}:
            own = self.best.get((dep.uses_link, link if dep.uses_link else 0, *which))
            other = [self.best.get((not dep.uses_link, k, *which)) for k in self._links(not dep.uses_link)]
            rates = ([own] if own is not None else []) + ([min(other)] if None not in other else [])
            if rates:
                out[which] = max(rates)
        return out

    def link_family_leads(self) -> bool:
        """Whether the link-using family won more of this L's (link, TBT target, SLO definition)
        cells than the colocated one, by every steady capacity (a family with none in a cell
        loses it; ties: no): the family to search first at the next L."""
        score = 0
        for tbt, slo in {(tbt, slo) for _, _, tbt, slo in self.steady}:
            colocated = self.steady.get((False, 0, tbt, slo), 0.0)
            for k in range(self.num_links):
                theirs = self.steady.get((True, k, tbt, slo), 0.0)
                score += (theirs > colocated) - (theirs < colocated)
        return score > 0
