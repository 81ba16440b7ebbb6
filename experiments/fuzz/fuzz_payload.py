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
import sys
from pathlib import Path

# heavy modules first, outside the instrumented import: only testbed's own code is instrumented
import msgpack
import torch  # noqa: F401
import xxhash  # noqa: F401

from campaign import Campaign, printable_error  # noqa: E402  (this folder)

MAX_HEADER = 64 * 1024
MAX_MESSAGE = 1 << 30


def payload_check(decode, payload_error, shown):
    """The promise of decode_header: a consistent KVPayload, or a PayloadError
    that is one printable line naming its request when it knows it."""
    def check(data: bytes) -> None:
        try:
            p = decode(data, MAX_HEADER, MAX_MESSAGE)
        except payload_error as e:
            message = str(e)
            printable_error(message)
            if e.request_id is not None and not message.startswith(f"request {shown(e.request_id)}: "):
                raise AssertionError(f"PayloadError does not name its request: {message[:200]!r}") from None
            return
        if not (0 < p.nbytes <= MAX_MESSAGE and len(p.shape) == 6 and p.shape[2] == len(p.block_ids)
                and p.shape[0] == p.layer_end - p.layer_start >= 0):
            raise AssertionError(f"inconsistent payload accepted: shape={p.shape} nbytes={p.nbytes}")
    return check


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
    campaign = Campaign("fuzz_payload", args.work_dir / "crashes", args.minutes * 60,
                        payload_check(decode_header, PayloadError, shown))
    campaign.warm(corpus)
    atheris.Setup([sys.argv[0], f"-max_len={MAX_HEADER + 16}", *libfuzzer_args, str(corpus)],
                  campaign.one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
