"""`testbed report SWEEP_DIR`'s capacity-vs-L figure, from a sweep of ordinary
runs (e.g. `testbed run -m runtime=sim mode=colocated,disagg
workload.prompt_len=1024,4096,16384 workload.prompt_dist=fixed`): the decision
study's figure (testbed/experiments/decision_figures.py) drawn from points
that were not searched for capacity.

Each point is read from its run directory: the resolved config (config.yaml:
mode, scheduler, token budget, pools, parallel config, workload.prompt_len)
and summary.json. The y value is **goodput per GPU**: requests/s that finished
within the run's SLOs (slo.ttft_ms, slo.tpot_ms), divided by the deployment's
GPU count. Goodput rather than throughput because a point past its capacity
still has a high throughput, made of requests that missed their SLOs; goodput
falls there, as capacity does. At one offered rate goodput is a lower bound on
capacity (it cannot exceed the rate); where the sweep also varies
workload.rate, each (deployment, L) takes its best goodput over the rates.
"""
from __future__ import annotations

from pathlib import Path

from omegaconf import OmegaConf

# the config fields that tell deployments apart (one line each); L and rate are the sweep's axes
_DEPLOYMENT_FIELDS = ("mode", "scheduler", "token_budget", "replicas", "prefill_workers", "decode_workers")


def _config(run_dir: Path) -> dict | None:
    for path in (run_dir / "config.yaml", run_dir / ".hydra" / "config.yaml"):
        if path.is_file():
            return OmegaConf.to_container(OmegaConf.load(path), resolve=False)
    return None


def num_gpus(config: dict, summary: dict) -> int:
    """summary.json's num_gpus when the run wrote one, else its workers x tp x pp."""
    if summary.get("num_gpus"):
        return int(summary["num_gpus"])
    parallel = config.get("parallel") or {}
    return max(1, len(summary.get("workers") or {})) * int(parallel.get("tp", 1)) * int(parallel.get("pp", 1))


def point(run_dir: Path, summary: dict) -> dict | None:
    """One run as a capacity point, None without a resolved config."""
    config = _config(run_dir)
    if config is None:
        return None
    gpus = num_gpus(config, summary)
    identity = {f: config.get(f) for f in _DEPLOYMENT_FIELDS} | {"num_gpus": gpus}
    return {"identity": identity, "context_len": int(config["workload"]["prompt_len"]),
            "rate": config["workload"].get("rate"), "capacity_per_gpu": summary["goodput"] / gpus,
            "source": config.get("runtime", {}).get("name", "sim"), "steady": not summary.get("interrupted"),
            "run_dir": str(run_dir)}


def _labels(identities: list[dict]) -> list[str]:
    """Each deployment by the fields in which the deployments differ ('mode=disagg scheduler=sarathi')."""
    varying = [f for f in identities[0] if len({str(i[f]) for i in identities}) > 1] or ["mode", "scheduler"]
    return [" ".join(f"{f}={i[f]}" for f in varying) for i in identities]


def capacity_rows(points: list[dict]) -> list[dict]:
    """The rows plot_capacity_vs_length takes: per (deployment, L, source) the best goodput per GPU."""
    identities = list({tuple(p["identity"].items()): p["identity"] for p in points}.values())
    label = dict(zip((tuple(i.items()) for i in identities), _labels(identities)))
    best: dict[tuple, dict] = {}
    for p in points:
        key = (label[tuple(p["identity"].items())], p["context_len"], p["source"])
        if key not in best or p["capacity_per_gpu"] > best[key]["capacity_per_gpu"]:
            best[key] = {"deployment": key[0], "context_len": key[1], "source": key[2],
                         "capacity_per_gpu": p["capacity_per_gpu"], "steady": p["steady"],
                         "num_gpus": p["identity"]["num_gpus"], "rate": p["rate"], "run_dir": p["run_dir"]}
    return sorted(best.values(), key=lambda r: (r["deployment"], r["context_len"]))


def plot_sweep_capacity(runs: list[tuple[Path, dict]], path: Path) -> Path | None:
    """runs: (run directory, summary) pairs. None when the runs span fewer than two prompt lengths."""
    from testbed.experiments.decision_figures import plot_capacity_vs_length
    points = [p for p in (point(d, s) for d, s in runs) if p is not None]
    if len({p["context_len"] for p in points}) < 2:
        return None
    rates = {p["rate"] for p in points}
    at = f"best over workload.rate in {sorted(rates)}" if len(rates) > 1 else f"at workload.rate={rates.pop()}"
    return plot_capacity_vs_length(capacity_rows(points), path,
                                   f"goodput per GPU (requests/s within the SLOs) against workload.prompt_len, {at}",
                                   ylabel="goodput per GPU (req/s)")
