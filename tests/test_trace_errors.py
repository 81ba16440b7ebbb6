"""Malformed trace files: each is refused with one error naming file:line and
what would be right, before any run starts; a line longer than the cap is
refused after reading about the cap, not the whole line."""
from __future__ import annotations

import contextlib
import io
import json
import re
import sys
import tracemalloc
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.cli import main
from testbed.text_lines import MAX_LINE_BYTES, text_lines
from testbed.workloads import WorkloadConfig, build_workload
from testbed.workloads.readers import MAX_TOKENS, READERS, AzureReader, JsonlReader

VOCAB = 4096
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
ROW1 = "2024-03-01 09:00:00.1000000,4000,12\n"


def azure_cfg(path: Path) -> WorkloadConfig:
    return WorkloadConfig(arrival="trace", prompt_dist="trace", output_dist="trace", trace_path=str(path),
                          trace_format="azure")


def refused(path: Path, fmt: str = "azure") -> str:
    cfg = WorkloadConfig(arrival="trace" if fmt != "sarathi_csv" else "poisson", prompt_dist="trace",
                         output_dist="trace", trace_path=str(path), trace_format=fmt)
    with pytest.raises(ValueError) as e:
        build_workload(cfg, VOCAB, seed=0)
    message = str(e.value)
    assert "\n" not in message, message
    return message


@pytest.mark.parametrize("text, line, message", [
    ("", 1, "the file is empty; expected a header line TIMESTAMP,ContextTokens,GeneratedTokens"),
    ("TIMESTAMP,Context,GeneratedTokens\n" + ROW1, 1, r"lacks column\(s\) \['ContextTokens'\]"),
    (AZURE_HEADER + ROW1 + "2024-03-01 09:00:00.2,-5,8\n", 3, "ContextTokens='-5' must be >= 1"),
    (AZURE_HEADER + ROW1 + "2024-03-01 09:00:00.2,3000,-1\n", 3, "GeneratedTokens='-1' must be >= 1"),
    (AZURE_HEADER + ROW1 + f"2024-03-01 09:00:00.2,{10**30},8\n", 3,
     f"ContextTokens='{10**30}' is above {MAX_TOKENS:,} tokens"),
    (AZURE_HEADER + ROW1 + f"2024-03-01 09:00:00.2,3000,{MAX_TOKENS + 1}\n", 3, "GeneratedTokens=.* is above"),
    (AZURE_HEADER + ROW1 + "2024-03-01 09:00:00.2,1e400,8\n", 3, "ContextTokens='1e400' is not an integer"),
    (AZURE_HEADER + ROW1 + "2024-03-01 08:59:58.62004,3000,8\n", 3,
     r"TIMESTAMP is 1.47996 s before line 2's; the trace must be in time order \(sort it by TIMESTAMP\)"),
    (AZURE_HEADER + ROW1 + ROW1, 3, "TIMESTAMP repeats line 2's: a duplicated row; remove it"),
    (AZURE_HEADER + ROW1 + '2024-03-01 09:00:04,"3000,8\n2024-03-01 09:00:05,1,1\n', 3,
     "a quoted field runs on past the end of its line; close its quote"),
    (AZURE_HEADER + ROW1 + '2024-03-01 09:00:04,"3000,8\n', 3, "a quoted field runs on past the end of its line"),
    (AZURE_HEADER + ROW1 + '2024-03-01 09:00:04,"30"00,8\n', 3, "not a CSV line"),
    (AZURE_HEADER + ROW1 + "2024-03-01 09:00:00.2,3000\n", 3, "expected 3 fields"),
])
def test_azure_trace_errors_name_file_and_line(tmp_path, text, line, message):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    assert re.search(rf"^{re.escape(str(path))}:{line}: .*{message}", refused(path)), refused(path)


def test_header_only_holds_no_requests(tmp_path):
    path = tmp_path / "trace.csv"
    path.write_text(AZURE_HEADER)
    assert refused(path) == (f"workload.trace_path: {path} holds no requests (no line after the header); "
                             "give a trace with at least one request")


@pytest.mark.parametrize("garbage, message", [
    (b"\x89PNG\r\n\x1a\n\0\0\0\rIHDR", ":1: .*a binary or mis-encoded file|:1: holds a NUL byte"),
    (AZURE_HEADER.encode() + b"2024-03-01 09:00:04,12\0\0,3\n", ":2: holds a NUL byte at column 23"),
    (AZURE_HEADER.encode() + b"\xff\xfe2023,3\n", r":2: byte 0xff at column 1 is not UTF-8 text"),
])
def test_binary_garbage_is_named_not_parsed(tmp_path, garbage, message):
    path = tmp_path / "trace.csv"
    path.write_bytes(garbage)
    assert re.search(message, refused(path)), refused(path)


def test_mooncake_out_of_order_is_refused_and_equal_milliseconds_are_not(tmp_path):
    def line(ts):
        return json.dumps({"timestamp": ts, "input_length": 10, "output_length": 2, "hash_ids": [1]}) + "\n"
    path = tmp_path / "mc.jsonl"
    path.write_text(line(0) + line(5) + line(5) + line(3))
    assert re.search(rf"{path}:4: timestamp is 0.002 s before line 3's; the trace must be in time order",
                     refused(path, "mooncake"))
    path.write_text(line(0) + line(5) + line(5))
    assert len(READERS["mooncake"](WorkloadConfig(hash_block_size=512), VOCAB).read(path)) == 3


def test_jsonl_nested_too_deep_and_non_utf8(tmp_path):
    path = tmp_path / "req.jsonl"
    path.write_text('{"prompt_len": 3, "max_tokens": 2}\n' + "[" * 100_000 + "]" * 100_000 + "\n")
    assert f"{path}:2: JSON nested too deeply" in refused(path, "jsonl")
    path.write_bytes(b'{"prompt_len": 3, "max_tokens": 2}\n{"prompt_len": 3\xc3\x28}\n')
    assert f"{path}:2: byte 0xc3 at column 17 is not UTF-8 text" in refused(path, "jsonl")


def _peak_bytes_while(fn) -> int:
    tracemalloc.start()
    try:
        fn()
    except ValueError:
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


@pytest.mark.parametrize("fmt", ["azure", "jsonl"])
def test_a_line_over_the_cap_is_refused_after_reading_about_the_cap(tmp_path, fmt):
    """A 16 MiB line against a 64 KiB cap: the error names the line, and the
    reader's peak memory stays near the cap (the whole line would be 16 MiB)."""
    cap, line_bytes = 64 << 10, 16 << 20
    path = tmp_path / f"long.{fmt}"
    with open(path, "wb") as f:
        f.write(AZURE_HEADER.encode() + ROW1.encode() if fmt == "azure"
                else b'{"prompt_len": 3, "max_tokens": 2}\n')
        f.write(b"7" * line_bytes + b"\n")
    reader = AzureReader() if fmt == "azure" else JsonlReader(VOCAB)
    line = 3 if fmt == "azure" else 2
    with pytest.raises(ValueError, match=rf"^{re.escape(str(path))}:{line}: line is longer than 65,536 bytes"):
        reader.read(path, max_line_bytes=cap)
    assert _peak_bytes_while(lambda: reader.read(path, max_line_bytes=cap)) < 8 * cap
    assert _peak_bytes_while(lambda: path.read_bytes().splitlines()) > line_bytes     # what it saves


def test_line_cap_counts_the_text_not_its_line_ending(tmp_path):
    path = tmp_path / "edge.txt"
    path.write_bytes(b"a" * 8 + b"\r\n" + b"b" * 8 + b"\n" + b"c" * 8)
    assert list(text_lines(path, 8)) == [(1, "a" * 8), (2, "b" * 8), (3, "c" * 8)]
    path.write_bytes(b"a" * 9 + b"\n")
    with pytest.raises(ValueError, match=":1: line is longer than 8 bytes"):
        list(text_lines(path, 8))


def _cli(overrides: list[str], run_dir: Path) -> tuple[int, list[str]]:
    err, argv = io.StringIO(), sys.argv[:]
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["run", "wandb.mode=disabled", "progress=false", f"hydra.run.dir={run_dir}", *overrides])
        except SystemExit as e:
            code = e.code
        finally:
            sys.argv = argv
    return code, err.getvalue().strip().splitlines()


def test_a_2gb_line_stops_the_cli_in_one_line_and_no_run_starts(tmp_path):
    """A real 2 GiB line (a sparse file: the disk holds almost none of it)
    through `testbed run workload=azure_code`: exit 2, one line naming file:2,
    no run directory outputs. Only MAX_LINE_BYTES of it is ever read."""
    path = tmp_path / "huge.csv"
    with open(path, "wb") as f:
        f.write(AZURE_HEADER.encode())
        f.truncate(len(AZURE_HEADER) + (2 << 30))
    run_dir = tmp_path / "run"
    code, lines = _cli(["workload=azure_code", f"workload.trace_path={path}"], run_dir)
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"error: {path}:2: line is longer than {MAX_LINE_BYTES:,} bytes (the most a line may "
                        "hold); is this the right file? A trace holds one request per line")
    assert not (run_dir / "summary.json").exists() and not (run_dir / "requests.jsonl").exists()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(fmt=st.sampled_from(sorted(READERS)),
       body=st.one_of(st.binary(max_size=300),
                      st.lists(st.text(st.characters(codec="utf-8"), max_size=40), max_size=6).map(
                          lambda lines: "\n".join(lines).encode())))
def test_any_bytes_give_rows_or_an_error_naming_the_file(tmp_path, fmt, body):
    """Whatever a trace file holds, a reader returns valid rows or raises
    ValueError naming the file; nothing else escapes."""
    path = tmp_path / f"fuzz.{fmt}"
    prefix = {"azure": AZURE_HEADER, "sarathi_csv": "num_prefill_tokens,num_decode_tokens\n"}.get(fmt, "")
    path.write_bytes(prefix.encode() + body)
    try:
        rows = READERS[fmt](WorkloadConfig(), VOCAB).read(path, max_line_bytes=128)
    except ValueError as e:
        assert str(path) in str(e) and "\n" not in str(e), str(e)
        return
    for row in rows:
        assert 1 <= row.prompt_len <= MAX_TOKENS and 1 <= row.output_len <= MAX_TOKENS
