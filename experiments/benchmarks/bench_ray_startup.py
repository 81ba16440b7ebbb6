"""Ray's start-up cost: the time from launching a run to the first
token of its first request, under `launcher=local` and under `launcher=ray`
(no `ray.address`: a cold local cluster in a private loopback-only network
namespace; and, with --join, `ray.address` pointing at a cluster already
running, in a namespace of its own), on the same tiny workload (disagg 1P1D,
tiny fp32 model on the CPU, a few short requests). Each repeat is a fresh
process (a private network namespace cannot be left); the launchers are
alternated, so that the machine's load drifts over all of them alike.

Printed per launcher: the median and the spread (min-max) over the repeats
of the launch-to-first-token time and of its parts:
  imports      process start to testbed and torch imported
  runtime      the config composed, the workload built, RealRuntime built (ray: the namespace entered)
  cluster      ray.init: the local cluster started, or the running one joined
  placement    placement groups placed and every actor up (its pid reported)
  workers      every worker built (model, KV cache, sockets) and Ready
  first token  serving begun to the first request's first token (its arrival and TTFT)

    python experiments/benchmarks/bench_ray_startup.py [--repeats 3] [--join] [override ...]
"""
from __future__ import annotations

import time

T_MAIN = time.monotonic()      # before the imports below: they are part of what a run pays

import argparse  # noqa: E402
import json  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
WORKLOAD = ["workload.num_requests=4", "workload.arrival=poisson", "workload.rate=50", "workload.prompt_dist=uniform",
            "workload.prompt_min=16", "workload.prompt_max=64", "workload.output_dist=uniform",
            "workload.output_min=4", "workload.output_max=8"]
BASE = ["mode=disagg", "progress=false", "wandb.mode=disabled", "timeout_s=120", *WORKLOAD]
# `ray start` (2.60) turns token authentication on (the token in ~/.ray/auth_token); a driver
# joining it must be told so, or it connects without the token and is refused
JOIN_ENV = dict(os.environ, RAY_AUTH_MODE="token")
PHASES = ("imports", "runtime", "cluster", "placement", "workers", "first token", "total")


def child(t_launch: float, overrides: list[str]) -> dict:
    """One run in this process; the monotonic time of each phase's end (CLOCK_MONOTONIC is system-wide)."""
    import torch  # noqa: F401
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from testbed.config import register_configs, validate
    from testbed.model.config import CONF_DIR
    from testbed.runtime.build import apply_sampling
    from testbed.runtime.real import RealRuntime
    from testbed.workloads.build import build_workload
    marks = {"launch": t_launch, "main": T_MAIN, "imports": time.monotonic()}

    def timed(cls, name: str, label: str) -> None:
        original = getattr(cls, name)

        def wrapper(self, *args, **kwargs):
            try:
                return original(self, *args, **kwargs)
            finally:
                marks.setdefault(label, time.monotonic())
        setattr(cls, name, wrapper)

    register_configs()
    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        cfg = OmegaConf.to_object(compose("config", overrides))
    validate(cfg)
    if cfg.launcher == "ray":
        from testbed.launchers.ray import RayLauncher
        timed(RayLauncher, "_init", "cluster")
        timed(RayLauncher, "prepare", "placement")
    timed(RealRuntime, "start", "workers")
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    rt = RealRuntime(cfg)
    marks["runtime"] = time.monotonic()
    result = rt.run(requests)
    assert all(r.status == "finished" for r in result.records), [(r.status, r.error) for r in result.records]
    first = min(result.records, key=lambda r: r.arrival_s)
    marks["first token"] = rt.clock.t0 + first.first_token_s
    marks.setdefault("cluster", marks["runtime"])        # launcher=local: no cluster, no placement
    marks.setdefault("placement", marks["cluster"])
    return {"marks": marks, "ttft_ms": (first.first_token_s - first.arrival_s) * 1000,
            "tokens": {r.request_id: r.output_token_ids for r in result.records}}


def phases(marks: dict) -> dict[str, float]:
    order = ["launch", "imports", "runtime", "cluster", "placement", "workers", "first token"]
    out = {b: marks[b] - marks[a] for a, b in zip(order, order[1:])}
    out["total"] = marks["first token"] - marks["launch"]
    return out


class PrivateCluster:
    """A Ray head on loopback inside a namespace of its own (tests/ray_cluster.py), for --join."""

    def __init__(self):
        sys.path.insert(0, str(REPO / "tests"))
        from ray_cluster import RayCluster
        self.netns = f"tb-raybench-{os.getpid()}"
        subprocess.run(["ip", "netns", "add", self.netns], check=True)
        subprocess.run(["ip", "netns", "exec", self.netns, "ip", "link", "set", "lo", "up"], check=True)
        try:
            self.cluster = RayCluster(num_cpus=2, netns=self.netns)       # its default host: loopback
            self._wait_up()
        except BaseException:
            self.close()
            raise

    def _wait_up(self, timeout_s: float = 180) -> None:
        """Until a driver inside the namespace can join (RayCluster.wait_nodes probes from outside)."""
        probe = "import ray,sys; ray.init(address=sys.argv[1], configure_logging=False, log_to_driver=False)"
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            r = subprocess.run(["ip", "netns", "exec", self.netns, sys.executable, "-c", probe,
                                self.cluster.address], capture_output=True, timeout=timeout_s, env=JOIN_ENV)
            if r.returncode == 0:
                return
            time.sleep(1)
        raise TimeoutError(f"the private Ray cluster was not up after {timeout_s} s: {self.cluster.logs()}")

    def close(self) -> None:
        if getattr(self, "cluster", None):
            self.cluster.stop()
        subprocess.run(["ip", "netns", "del", self.netns], check=False)


def one(launcher: str, extra: list[str], netns: str | None) -> dict:
    cmd = [sys.executable, __file__, "--child", str(time.monotonic()), *BASE, f"launcher={launcher}", *extra]
    if netns:
        cmd = ["ip", "netns", "exec", netns, *cmd]
    proc = subprocess.run(cmd, capture_output=True, text=True,
                          env=dict(JOIN_ENV if netns else os.environ, OMP_NUM_THREADS="1"))
    if proc.returncode != 0:
        raise RuntimeError(f"{launcher} {extra}: exit {proc.returncode}\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "--child":
        print(json.dumps(child(float(sys.argv[2]), sys.argv[3:])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--join", action="store_true", help="also launcher=ray joining a running cluster (ray.address)")
    ap.add_argument("overrides", nargs="*")
    args = ap.parse_args()
    private = PrivateCluster() if args.join else None
    try:
        variants = {"local": ("local", [], None), "ray (cold local cluster)": ("ray", [], None)}
        if private:
            variants["ray (joins a running cluster)"] = ("ray", [f"ray.address={private.cluster.address}"],
                                                        private.netns)
        runs: dict[str, list[dict]] = {name: [] for name in variants}
        for i in range(args.repeats):
            for name, (launcher, extra, netns) in variants.items():
                res = one(launcher, [*extra, *args.overrides], netns)
                runs[name].append(res)
                print(f"repeat {i + 1} {name}: launch to first token {phases(res['marks'])['total']:.2f} s, "
                      f"TTFT {res['ttft_ms']:.0f} ms", flush=True)
    finally:
        if private:
            private.close()
    tokens = [r["tokens"] for rs in runs.values() for r in rs]
    print(f"\ntokens identical across all {len(tokens)} runs: {all(t == tokens[0] for t in tokens)}")
    print(f"\nseconds, median [min-max] over {args.repeats} repeats (2 shared cores: noisy)")
    print(f"{'phase':<12}" + "".join(f"{name:>34}" for name in runs))
    for phase in PHASES:
        cells = []
        for rs in runs.values():
            xs = [phases(r["marks"])[phase] for r in rs]
            cells.append(f"{statistics.median(xs):7.2f} [{min(xs):.2f}-{max(xs):.2f}]")
        print(f"{phase:<12}" + "".join(f"{c:>34}" for c in cells))
    ttfts = ["{:.0f} [{:.0f}-{:.0f}]".format(statistics.median(x), min(x), max(x))
             for x in ([r["ttft_ms"] for r in rs] for rs in runs.values())]
    print(f"{'TTFT ms':<12}" + "".join(f"{c:>34}" for c in ttfts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
