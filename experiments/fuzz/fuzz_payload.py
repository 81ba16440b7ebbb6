"""Coverage-guided fuzzing of the KV payload header decoder with atheris.

    .venv/bin/pip install -e .[fuzz]        # atheris (optional extra)
    .venv/bin/python experiments/fuzz/fuzz_payload.py --minutes 5

decode_header (kv_transfer/payload.py) reads the first frame of every KV
message a decode worker receives, from whoever connects to its socket. For
each input libFuzzer makes, this checks what tests/test_wire_fuzz.py checks
with hypothesis, but for minutes and guided by coverage:
- it returns a consistent KVPayload (size within max_message_bytes, shape
  matching layers and blocks) or raises PayloadError with a one-line,
  printable message; any other exception, or a broken promise, is a crash;
- Python allocations while decoding stay under 100x the header's bytes plus
  64 KiB (checked on every 64th input: tracemalloc is slow).
A crash is counted and its input saved under WORK_DIR/crashes/, and fuzzing
goes on, so one run reports every distinct crash it met (by exception type and
line). At the end it prints the executions, the distinct crashes and the rate,
and exits 1 if there was any crash. Arguments it does not know go to libFuzzer.
"""
from __future__ import annotations

import argparse
import hashlib
import os
import sys
import time
import tracemalloc
from pathlib import Path

# heavy modules first, outside the instrumented import: only testbed's own code is instrumented
import msgpack
import torch  # noqa: F401
import xxhash  # noqa: F401

MAX_HEADER = 64 * 1024
MAX_MESSAGE = 1 << 30


class Campaign:
    """Counts executions and distinct crashes; saves each crash's input."""

    def __init__(self, crash_dir: Path, seconds: float, decode, payload_error, shown) -> None:
        self.crash_dir = crash_dir
        self.decode, self.payload_error, self.shown = decode, payload_error, shown
        self.executions = 0
        self.crashes: dict[str, Path] = {}      # signature -> saved input
        self.t0 = time.monotonic()
        self.deadline = self.t0 + seconds

    def one_input(self, data: bytes) -> None:
        self.executions += 1
        if self.executions % 1024 == 0 and time.monotonic() >= self.deadline:
            # libFuzzer's own -max_total_time leaves by _exit, skipping atexit: report here
            self.report()
            os._exit(1 if self.crashes else 0)
        measure = self.executions % 64 == 0
        try:
            if measure:
                tracemalloc.start()
            try:
                self._check(data)
            finally:
                if measure:
                    peak = tracemalloc.get_traced_memory()[1]
                    tracemalloc.stop()
            if measure and peak > 100 * len(data) + (64 << 10):
                raise AssertionError(f"decoding {len(data)} bytes allocated {peak} bytes")
        except Exception as e:      # a crash: record it and keep fuzzing
            self._record(e, data)

    def _check(self, data: bytes) -> None:
        try:
            p = self.decode(data, MAX_HEADER, MAX_MESSAGE)
        except self.payload_error as e:
            message = str(e)
            if not message.isprintable() or len(message) > 1000:
                raise AssertionError(f"unprintable or long PayloadError: {message[:200]!r}") from None
            if e.request_id is not None and not message.startswith(f"request {self.shown(e.request_id)}: "):
                raise AssertionError(f"PayloadError does not name its request: {message[:200]!r}") from None
            return
        if not (0 < p.nbytes <= MAX_MESSAGE and len(p.shape) == 6 and p.shape[2] == len(p.block_ids)
                and p.shape[0] == p.layer_end - p.layer_start >= 0):
            raise AssertionError(f"inconsistent payload accepted: shape={p.shape} nbytes={p.nbytes}")

    def _record(self, e: Exception, data: bytes) -> None:
        tb = e.__traceback__
        while tb is not None and tb.tb_next is not None:
            tb = tb.tb_next
        where = f"{tb.tb_frame.f_code.co_filename}:{tb.tb_lineno}" if tb is not None else "?"
        signature = f"{type(e).__name__} at {where}"
        if signature in self.crashes:
            return
        self.crash_dir.mkdir(parents=True, exist_ok=True)
        path = self.crash_dir / f"crash-{hashlib.sha1(data).hexdigest()[:16]}"
        path.write_bytes(data)
        self.crashes[signature] = path
        print(f"\nCRASH {signature}: {str(e)[:300]} (input: {path})", file=sys.stderr, flush=True)

    def report(self) -> None:
        elapsed = time.monotonic() - self.t0
        print(f"\nfuzz_payload: {self.executions:,} executions in {elapsed:.0f} s "
              f"({self.executions / max(elapsed, 1e-9):,.0f}/s), {len(self.crashes)} distinct crash(es)",
              flush=True)
        for signature, path in self.crashes.items():
            print(f"  {signature}  input: {path}", flush=True)


def seed_corpus(directory: Path) -> None:
    """A few well-formed headers (whole, layer-wise, odd dtypes) to start from."""
    directory.mkdir(parents=True, exist_ok=True)
    for i, (dtype, itemsize) in enumerate([("float32", 4), ("bfloat16", 2), ("float8_e4m3fn", 1)]):
        blocks = list(range(i + 1))
        shape = [2, 2, len(blocks), 16, 2, 8]
        nbytes = itemsize
        for d in shape:
            nbytes *= d
        header = {"v": 1, "request_id": f"r{i}", "layer_start": i, "layer_end": i + 2, "block_ids": blocks,
                  "num_tokens": 16 * len(blocks), "dtype": dtype, "shape": shape, "checksum": 12345 + i,
                  "nbytes": nbytes, "last": i != 1, "meta": {"first_token": 7, "t": 0.5}}
        (directory / f"seed-{i}").write_bytes(msgpack.packb(header))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz")
    ap.add_argument("--work-dir", type=Path, default=Path("outputs/fuzz_payload"),
                    help="corpus/ and crashes/ go here")
    args, libfuzzer_args = ap.parse_known_args()

    import atheris
    with atheris.instrument_imports(include=["testbed"]):
        from testbed.kv_transfer.payload import PayloadError, decode_header
        from testbed.wire_text import shown

    corpus = args.work_dir / "corpus"
    seed_corpus(corpus)
    campaign = Campaign(args.work_dir / "crashes", args.minutes * 60, decode_header, PayloadError, shown)
    atheris.Setup([sys.argv[0], f"-max_len={MAX_HEADER + 16}", *libfuzzer_args, str(corpus)],
                  campaign.one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
