"""`testbed run experiment=decision` with experiment.parallel=1 (serial, in
process) against parallel=auto (Ray tasks on every core), alternated
(1, auto, 1, auto, ...), each run's wall time (the whole process, Ray's start
and stop included) and the 1-minute load average before and after it; then
whether every run wrote the same files (the timing fields aside:
decision_probes.csv's wall_s, cpu_s, load_1m; the summaries' elapsed_s,
probe_cpu_s, probe_wall_s). The noise floor is the spread between the runs
of one setting.

    python experiments/benchmarks/bench_decision_parallel.py --pairs 2 --out /tmp/bench [OVERRIDE ...]

Overrides go to every run (a smaller cut of the grid: experiment.context_lens=[...]);
data.dir must hold vidur-profiles for the default grid's h100-sxm."""
from __future__ import annotations

import argparse
import csv
import io
import json
import os
import subprocess
import sys
import time
from pathlib import Path

TIMING_COLUMNS = ("wall_s", "cpu_s", "load_1m")
TIMING_KEYS = ("elapsed_s", "probe_cpu_s", "probe_wall_s")


def files_of(out: Path) -> dict[str, bytes]:
    files = {}
    for path in sorted(out.iterdir()):
        if path.is_dir() or path.name == "cli.log":
            continue
        data = path.read_bytes()
        if path.name == "decision_probes.csv":
            rows = [{k: v for k, v in r.items() if k not in TIMING_COLUMNS}
                    for r in csv.DictReader(io.StringIO(data.decode()))]
            data = json.dumps(rows).encode()
        elif path.suffix == ".json":
            d = json.loads(data)
            for k in TIMING_KEYS:
                d.pop(k, None)
            data = json.dumps(d, sort_keys=True).encode()
        files[path.name] = data
    return files


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pairs", type=int, default=2)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    testbed = str(Path(sys.executable).with_name("testbed"))
    times: dict[str, list[float]] = {"1": [], "auto": []}
    outs = []
    for i in range(a.pairs):
        for parallel in ("1", "auto"):
            out = a.out / f"{i}-{parallel}"
            load0 = os.getloadavg()[0]
            t0 = time.monotonic()
            r = subprocess.run([testbed, "run", "experiment=decision", "wandb.mode=disabled", *a.overrides,
                                f"experiment.parallel={parallel}", f"hydra.run.dir={out}"],
                               capture_output=True, text=True)
            wall = time.monotonic() - t0
            if r.returncode:
                print(r.stdout[-2000:], r.stderr[-2000:])
                return 1
            times[parallel].append(wall)
            outs.append(out)
            print(f"parallel={parallel:4} run {i}: {wall:7.1f} s wall  (load 1m {load0:.2f} before, "
                  f"{os.getloadavg()[0]:.2f} after)", flush=True)
    for parallel, ts in times.items():
        mean = sum(ts) / len(ts)
        print(f"parallel={parallel:4}: mean {mean:.1f} s, spread {max(ts) - min(ts):.1f} s "
              f"({(max(ts) - min(ts)) / mean:.0%} of the mean: the noise floor)")
    ratio = (sum(times["auto"]) / len(times["auto"])) / (sum(times["1"]) / len(times["1"]))
    print(f"auto / serial: {ratio:.2f}x")
    first = files_of(outs[0])
    same = all(files_of(o) == first for o in outs[1:])
    print(f"files the same in all {len(outs)} runs (timing fields aside): {same}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
