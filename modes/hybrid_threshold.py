"""`hybrid.threshold=auto`: the threshold is the system crossover L* that the
decision study measured (experiment=decision writes decision_summary.json):
the shortest context from which the best disaggregated deployment serves
more requests per GPU than the best colocated one, for this model, hardware
and link. Among that triple's entries the one with the run's smoothness
definition (`hybrid.slo`) and GPU count is preferred, then the nearest GPU
count, then the run's TBT target; ties go to the first in the file."""
from __future__ import annotations

import json
from pathlib import Path


def threshold_from_summary(path: str, model: str, hardware: str, link: str, num_gpus: int, slo: str,
                           tbt_slo_ms: float) -> tuple[int, str]:
    """(L*, a line saying which entry it came from); a clear error naming
    hybrid.decision_summary when the file, the entry or its L* is missing."""
    p = Path(path)
    if not p.is_file():
        raise ValueError(f"hybrid.decision_summary: no file '{path}'; run experiment=decision (it writes "
                         f"decision_summary.json) and point hybrid.decision_summary at it, or set hybrid.threshold "
                         f"to a prompt length")
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hybrid.decision_summary: '{path}' is not JSON ({e})") from None
    entries = data.get("crossovers") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not all(isinstance(e, dict) for e in entries):
        raise ValueError(f"hybrid.decision_summary: '{path}' has no 'crossovers' list of entries "
                         f"(the format experiment=decision writes)")
    matching = [e for e in entries if (e.get("model"), e.get("hardware"), e.get("link")) == (model, hardware, link)]
    if not matching:
        have = sorted({f"{e.get('model')}/{e.get('hardware')}/{e.get('link')}" for e in entries})
        raise ValueError(f"hybrid.threshold=auto: '{path}' has no crossover for model={model} hardware={hardware} "
                         f"link={link} (it has: {', '.join(have) or 'none'}); run experiment=decision for them, "
                         f"or set hybrid.threshold to a prompt length")

    def distance(e: dict) -> tuple:
        gpus = e.get("num_gpus")
        return (e.get("slo") != slo, gpus != num_gpus, abs(gpus - num_gpus) if isinstance(gpus, int) else 1 << 30,
                e.get("tbt_slo_ms") != tbt_slo_ms)
    best = min(matching, key=distance)
    what = (f"{model}/{hardware}/{link}, num_gpus={best.get('num_gpus')}, slo={best.get('slo')}, "
            f"tbt_slo_ms={best.get('tbt_slo_ms')}")
    l_star = best.get("l_star")
    if l_star is None:
        raise ValueError(f"hybrid.threshold=auto: the crossover in '{path}' for {what} is null: the best "
                         f"disaggregated deployment never overtook the best colocated one in the study's grid; "
                         f"set hybrid.threshold to a prompt length, or use mode=colocated")
    if isinstance(l_star, bool) or not isinstance(l_star, int) or l_star < 1:
        raise ValueError(f"hybrid.decision_summary: l_star for {what} in '{path}' is {l_star!r}, not a prompt length")
    return l_star, f"hybrid.threshold=auto -> {l_star} (from {path}: {what})"
