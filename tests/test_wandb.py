"""W&B logging, for real: offline runs (never online) written under tmp_path,
read back from the run's files: the transaction log (run-*.wandb, LevelDB-style
records of wandb's protobuf Record) for the config, summary and history, and
the table and image files under files/media."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

wandb_pb = pytest.importorskip("wandb.proto.wandb_internal_pb2")

from testbed.config import from_dict  # noqa: E402
from testbed.metrics import read_iterations, read_requests  # noqa: E402
from testbed.run import execute  # noqa: E402

_BLOCK = 32768
_HEADER = 7          # ':W&B', magic 0xBEE1, version 0 at the file's start; then per record crc32, length, type


def read_records(path: Path) -> list:
    """Every Record of a .wandb transaction log (LevelDB log format: 32 KiB
    blocks of records, each FULL or split FIRST/MIDDLE.../LAST), up to one
    the writer has not finished."""
    data = path.read_bytes()
    assert data[:4] == b":W&B", f"{path} is not a W&B transaction log"
    pos, payloads, parts = _HEADER, [], b""
    while pos + _HEADER <= len(data):
        left = _BLOCK - pos % _BLOCK
        if left < _HEADER:                   # a block's tail too short for a header is padding
            pos += left
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + _HEADER])
        if pos + _HEADER + length > len(data):
            break                            # a record the service is still writing: read again later
        payload = data[pos + _HEADER:pos + _HEADER + length]
        pos += _HEADER + length
        if kind == 0:
            pos += _BLOCK - pos % _BLOCK
        elif kind == 1:
            payloads.append(payload)
        elif kind == 2:
            parts = payload
        elif kind == 3:
            parts += payload
        elif kind == 4:
            payloads.append(parts + payload)
    return [wandb_pb.Record.FromString(p) for p in payloads]


def _key(item) -> str:
    return item.key or "/".join(item.nested_key)


class Logged:
    """What an offline run logged: config, final summary, history rows, files."""

    def __init__(self, out_dir: Path, timeout_s: float = 30.0):
        runs = list((out_dir / "wandb").glob("offline-run-*"))
        assert len(runs) == 1, runs
        self.dir = runs[0]
        # wandb's service process writes the log; run.finish() can return
        # before its last records reach the file: wait for the exit record
        deadline = time.monotonic() + timeout_s
        while True:
            records = read_records(next(self.dir.glob("run-*.wandb")))
            kinds = {r.WhichOneof("record_type") for r in records}
            if "exit" in kinds or time.monotonic() > deadline:
                break
            time.sleep(0.2)
        assert {"run", "exit"} <= kinds, f"{self.dir}: the transaction log has only {sorted(kinds)}"
        run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
        self.group, self.name, self.job_type = run.run_group, run.display_name, run.job_type
        self.config = {u.key: json.loads(u.value_json) for u in run.config.update}
        self.summary: dict = {}
        self.history: list[dict] = []
        self.charts: dict[str, dict] = {}
        for r in records:
            kind = r.WhichOneof("record_type")
            if kind == "summary":
                self.summary.update({_key(u): json.loads(u.value_json) for u in r.summary.update})
            elif kind == "history":
                self.history.append({_key(i): json.loads(i.value_json) for i in r.history.item})
            elif kind == "config":
                self.config.update({u.key: json.loads(u.value_json) for u in r.config.update if u.key})
                # custom charts (wandb.plot.*): their panel under _wandb/visualize/KEY
                self.charts.update({"/".join(u.nested_key[2:]): json.loads(u.value_json) for u in r.config.update
                                    if list(u.nested_key[:2]) == ["_wandb", "visualize"]})

    def table(self, key: str) -> dict:
        """The logged wandb.Table under `key`, from its file."""
        path = self.dir / "files" / self.summary[f"{key}/path"]
        return json.loads(path.read_text())


@pytest.fixture
def offline(tmp_path, monkeypatch):
    """wandb writes nothing outside tmp_path and never goes online."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    for var in ("WANDB_CACHE_DIR", "WANDB_CONFIG_DIR", "WANDB_DATA_DIR", "WANDB_ARTIFACT_DIR"):
        monkeypatch.setenv(var, str(tmp_path / "wandb-home" / var.lower()))
    monkeypatch.setenv("WANDB_SILENT", "true")
    return tmp_path


SIM_RUN = {"runtime": {"name": "sim"}, "model": {"name": "tiny"}, "wandb": {"mode": "offline", "group": "g1"},
           "workload": {"num_requests": 5, "prompt_min": 16, "prompt_max": 64, "output_min": 4, "output_max": 8,
                        "rate": 50.0}}


def test_a_run_logs_config_summary_iterations_and_requests(offline):
    out = offline / "run"
    summary = execute(from_dict(SIM_RUN), out)
    logged = Logged(out)

    assert logged.config["runtime"]["name"] == "sim" and logged.config["workload"]["num_requests"] == 5
    assert logged.config["wandb"]["group"] == "g1"
    for key in ("num_requests", "num_finished", "duration_s", "goodput"):
        assert logged.summary[key] == pytest.approx(summary[key]), key
    assert logged.summary["ttft_ms/p99"] == pytest.approx(summary["ttft_ms"]["p99"])
    assert logged.summary["tbt_ms/max"] == pytest.approx(summary["tbt_ms"]["max"])
    assert "workers/replica0/num_blocks" not in logged.summary       # per-worker stats stay in summary.json

    # one history row per iteration, with its numbers
    iterations = read_iterations(out / "iterations.jsonl")
    rows = [h for h in logged.history if "iteration/duration_ms" in h]
    assert len(rows) == len(iterations) > 5
    assert [h["iteration/num_prefill_tokens"] for h in rows] == [it.num_prefill_tokens for it in iterations]
    assert [h["iteration/duration_ms"] for h in rows] == pytest.approx([it.duration_s * 1e3 for it in iterations])

    # the per-request table, row for row
    table = logged.table("requests")
    records = read_requests(out / "requests.jsonl")
    col = {c: i for i, c in enumerate(table["columns"])}
    assert [row[col["request_id"]] for row in table["data"]] == [r.request_id for r in records]
    assert [row[col["prompt_len"]] for row in table["data"]] == [r.prompt_len for r in records]
    assert [row[col["ttft_ms"]] for row in table["data"]] == pytest.approx([r.ttft_s * 1e3 for r in records])


def test_disabled_writes_no_wandb_files(tmp_path):
    out = tmp_path / "run"
    execute(from_dict({**SIM_RUN, "wandb": {"mode": "disabled"}}), out)
    assert (out / "summary.json").is_file() and not (out / "wandb").exists()


def test_an_experiment_logs_its_table_figures_and_summary(offline):
    out = offline / "exp"
    cfg = from_dict({"wandb": {"mode": "offline"},
                     "experiment": {"name": "hybrid_batch", "real": False, "models": ["llama3-8b"],
                                    "hardware": ["h100-sxm"], "context_lens": [4096], "chunk_sizes": [512, 1024],
                                    "real_models": [], "num_decodes": 4, "decode_context_len": 256}})
    result = execute(cfg, out)
    logged = Logged(out)

    assert logged.config["experiment"]["name"] == "hybrid_batch"
    assert logged.summary["num_points"] == result["num_points"] == 4
    table = logged.table("hybrid_batch/table")
    with open(out / "hybrid_batch.csv") as f:
        csv_rows = f.read().splitlines()
    assert table["columns"] == csv_rows[0].split(",")
    assert len(table["data"]) == len(csv_rows) - 1 == 4
    col = table["columns"].index("batch")
    assert [r[col] for r in table["data"]] == ["decode_only", "decode+whole_prefill", "decode+chunk", "decode+chunk"]

    assert logged.summary["figures/hybrid_batch/_type"] == "image-file"
    logged_png = logged.dir / "files" / logged.summary["figures/hybrid_batch/path"]
    assert logged_png.read_bytes() == (out / "hybrid_batch.png").read_bytes()


def test_an_experiment_logs_line_series_and_the_l_star_table(offline):
    out = offline / "crossover"
    lengths = [1024, 2048, 4096, 8192, 16384]
    cfg = from_dict({"wandb": {"mode": "offline"},
                     "experiment": {"name": "crossover", "real": False, "models": ["llama3-8b"],
                                    "hardware": ["h100-sxm"], "links": ["tcp-25", "rdma-400"],
                                    "chunk_sizes": [512, 2048], "context_lens": lengths}})
    result = execute(cfg, out)
    logged = Logged(out)
    assert "series" not in result and "tables" not in result           # popped: W&B's, not experiment.json's
    assert "series" not in json.loads((out / "experiment.json").read_text())

    # one line series per model/hardware/link: re-read at each chunk size, transfer whole and exposed
    with open(out / "crossover.csv") as f:
        import csv
        rows = list(csv.DictReader(f))
    for link in ("tcp-25", "rdma-400"):
        key = f"crossover/taxes/llama3-8b/h100-sxm/{link}"
        chart = logged.charts[key]
        assert chart["panel_config"]["panelDefId"] == "wandb/lineseries/v0"
        assert chart["panel_config"]["stringSettings"]["xname"] == "context_len"
        table = logged.table(f"{key}_table")
        assert table["columns"] == ["step", "lineKey", "lineVal"]
        lines: dict[str, dict[int, float]] = {}
        for x, line, y in table["data"]:
            lines.setdefault(line, {})[x] = y
        riding = {f"piggyback_b{b}_ms C=512" for b in (0, 8, 32, 128)}
        assert set(lines) == {"reread_ms C=512", "reread_ms C=2048", "transfer_ms", "exposed_transfer_ms"} | riding
        for r in (r for r in rows if r["link"] == link):
            n = int(r["context_len"])
            assert lines[f"reread_ms C={r['chunk_size']}"][n] == pytest.approx(float(r["reread_ms"]))
            assert lines["transfer_ms"][n] == pytest.approx(float(r["transfer_ms"]))
            if r["chunk_size"] == "512":
                assert lines["piggyback_b32_ms C=512"][n] == pytest.approx(float(r["piggyback_b32_ms"]))
    assert not any(k.startswith("crossover/taxes/") for k in logged.charts if k.count("/") != 4)

    # the L* table: one row per model/hardware/link/chunk, as in crossover_summary.json
    lstar = logged.table("crossover/lstar")
    summary = json.loads((out / "crossover_summary.json").read_text())
    col = {c: i for i, c in enumerate(lstar["columns"])}
    assert [(r[col["link"]], r[col["chunk_size"]], r[col["L_star_time"]]) for r in lstar["data"]] == \
        [(e["link"], e["chunk_size"], e["L_star_time"]) for e in summary]
    assert logged.summary["figures/crossover_llama3-8b/_type"] == "image-file"
