"""ProbeCache: the decision study's simulated probes kept on disk
(`experiment.probe_cache=DIR`), so that a grid cut short resumes where it
stopped instead of starting over. `decision-full` takes many core-hours
(experiments/README.md); a sweep point killed at hour five, or re-run to add a link, replays
the probes it already ran from here and runs only the rest.

The simulator is deterministic: the same run config gives the same records.
So a probe is keyed by its run config (rate and number of requests
included; the `experiment`, `wandb` and `progress` nodes left out, as the
runtime never reads them, so sweep points and the default grid share
probes) and by the code stamp: a hash of the package's source and conf/
presets, so any change to the code or a preset starts a fresh cache rather
than replaying results the new code would not give.

An entry keeps what the study reads of a probe: its counts, its
steady-state window's figures, the wall time it took, and the verdict of
every SLO definition that judged it (not its records: a probe's token times
are megabytes). A definition that never judged it before re-runs the probe
(decision_prober.py ProbeRun.judge) and checks that the run gives the same
counts.

Files: JSON lines, one file per process (two sweep points running at once
never write the same file), each line an entry; a later line for the same
key adds the verdicts judged since. All files in the directory are read at
start; a torn last line (a process killed mid-write) is skipped."""
from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

from testbed.config import RunConfig

# nodes of the run config a simulated run never reads
_NOT_READ = ("experiment", "wandb", "progress")


def code_stamp() -> str:
    """A hash of every file of the testbed's packages and its conf/ presets."""
    import testbed
    import testbed.kernels
    import testbed.kv_transfer
    import testbed.modes
    from testbed.model.config import CONF_DIR
    roots = {Path(m.__file__).parent for m in (testbed, testbed.kernels, testbed.kv_transfer, testbed.modes)}
    roots.add(Path(CONF_DIR))
    h = hashlib.sha256()
    for root in sorted(roots):
        for path in sorted(p for p in root.rglob("*") if p.is_file() and "__pycache__" not in p.parts):
            h.update(str(path.relative_to(root.parent)).encode())
            h.update(path.read_bytes())
    return h.hexdigest()[:16]


class ProbeCache:
    def __init__(self, directory: str | Path, log=print):
        self.dir = Path(directory).expanduser().resolve()
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise ValueError(f"experiment.probe_cache: cannot create the directory {self.dir} ({e}); "
                             f"give a writable path, or '' for no cache") from None
        self.stamp = code_stamp()
        self.entries: dict[str, dict] = {}
        self._file = None
        other_code = torn = 0
        for entry in read_entries(self.dir):
            if entry is None:
                torn += 1
                continue
            if entry.get("stamp") != self.stamp:
                other_code += 1
                continue
            known = self.entries.get(entry["key"])
            if known is not None:
                entry["verdicts"] = {**known["verdicts"], **entry["verdicts"]}
            self.entries[entry["key"]] = entry
        log(f"decision: probe cache {self.dir}: {len(self.entries)} probes of this code ({self.stamp})"
            + (f", {other_code} lines of other code versions ignored" if other_code else "")
            + (f", {torn} torn lines skipped" if torn else ""))

    @staticmethod
    def key(cfg: RunConfig) -> str:
        d = dataclasses.asdict(cfg)       # (config.to_dict's OmegaConf round trip: ~150 ms a probe)
        for name in _NOT_READ:
            d.pop(name, None)
        return hashlib.sha256(json.dumps(d, sort_keys=True, default=repr).encode()).hexdigest()

    def get(self, key: str) -> dict | None:
        return self.entries.get(key)

    def put(self, key: str, entry: dict) -> None:
        """Keep `entry` (the probe's figures and verdicts so far) under `key`, on disk at once."""
        entry = {**entry, "key": key, "stamp": self.stamp}
        self.entries[key] = entry
        if self._file is None:
            name = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:8]}.jsonl"
            self._file = open(self.dir / name, "a")
        self._file.write(json.dumps(entry) + "\n")
        self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


def read_entries(directory: Path) -> Iterator[dict | None]:
    """Every line of every cache file in `directory`, of any code stamp, in file
    order; None for a torn line (a process killed mid-write)."""
    for path in sorted(Path(directory).glob("*.jsonl")):
        for line in path.read_text().splitlines():
            try:
                yield json.loads(line)
            except json.JSONDecodeError:
                yield None


def entry_of(run) -> dict:
    """A ProbeRun's figures as a cache entry (decision_prober.py ProbeRun)."""
    w = run.window
    return {"num_requests": run.num_requests, "num_finished": run.num_finished, "num_judged": run.num_judged,
            "steady": w.steady, "reason": w.reason, "span_s": w.span_s, "service_s": w.service_s,
            "wall_s": run.wall_s, "cpu_s": run.cpu_s, "load_1m": run.load_1m, "verdicts": dict(run.verdicts),
            "first_stuck": run.first_stuck}


def same_counts(entry: dict, run) -> bool:
    """Whether a re-run gave the cached probe's figures (determinism check)."""
    fresh = entry_of(run)
    return all(fresh[k] == entry[k] for k in ("num_requests", "num_finished", "num_judged", "steady",
                                              "span_s", "service_s"))

