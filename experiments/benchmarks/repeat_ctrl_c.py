"""The Ctrl-C tests N times in a row (the target: 20 in a row with a CPU hog
beside it): each repeat is one pytest process running
tests/test_serving.py's Ctrl-C test and tests/test_signals.py's steady-state
SIGINT test, each of which starts its own CPU hog (two busy loops) beside the
run. Stops at the first failure and prints its output; prints every repeat's
exit latency (seconds from the signal to the run's exit, as the tests print
them) and, at the end, passes, failures, p50 and max.

    python experiments/benchmarks/repeat_ctrl_c.py [-n 20] [--test NODEID ...]
"""
from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TESTS = ["tests/test_serving.py::test_ctrl_c_writes_what_was_measured_and_leaves_no_process",
         "tests/test_signals.py::test_a_signal_at_any_phase_stops_the_run_within_10_s_and_keeps_what_it_measured"
         "[steady-SIGINT]"]
LATENCY = re.compile(r"(\S+): exit (-?\d+|None) ([\d.]+) s after the signal")


def one_repeat(tests: list[str]) -> tuple[bool, list[tuple[str, float]], str, float]:
    """(passed, [(which, seconds from the signal to exit)], pytest's output, wall seconds)."""
    start = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "pytest", "-x", "-q", "-s", "-m", "", "-p", "no:cacheprovider",
                           *tests], cwd=REPO, capture_output=True, text=True, env=dict(os.environ))
    out = proc.stdout + proc.stderr
    latencies = [(m.group(1), float(m.group(3))) for m in LATENCY.finditer(out)]
    return proc.returncode == 0, latencies, out, time.monotonic() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("-n", type=int, default=20, help="repeats (default 20)")
    ap.add_argument("--test", action="append", help="a pytest node id (default: both Ctrl-C tests)")
    args = ap.parse_args()
    tests = args.test or TESTS
    passes, latencies = 0, []
    for i in range(1, args.n + 1):
        ok, took, out, wall = one_repeat(tests)
        latencies += [s for _, s in took]
        print(f"repeat {i:2d}/{args.n}: {'pass' if ok else 'FAIL'}  " +
              "  ".join(f"{which} {s:.2f} s" for which, s in took) + f"  (pytest {wall:.0f} s)", flush=True)
        if not ok:
            print(out[-6000:])
            break
        passes += 1
    failures = 0 if passes == args.n else 1
    print(f"\n{passes} passed, {failures} failed, of {args.n} repeats in a row")
    if latencies:
        print(f"exit latency after the signal over {len(latencies)} runs: p50 {statistics.median(latencies):.2f} s, "
              f"max {max(latencies):.2f} s (bound 10 s)")
    return 0 if failures == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
