"""Coverage-guided fuzzing of the command/event decoder with atheris.

    .venv/bin/pip install -e .[fuzz]        # atheris (optional extra)
    .venv/bin/python experiments/fuzz/fuzz_wire.py --minutes 5

testbed/runtime/wire.py's decode reads every frame the frontend's event socket
and a worker's command socket receive. For each input libFuzzer makes, this
checks what tests/test_wire.py checks with hypothesis, for minutes and guided
by coverage: decode returns a message of a known kind whose encoding decodes
to an equal message, or raises WireError with a one-line printable message;
any other exception, or an allocation past 100x the input plus 64 KiB, is a
crash (experiments/fuzz/campaign.py). The seed corpus is one encoded example
of every message kind. At the end it prints the executions and the distinct
crashes, and exits 1 if there was any. Arguments it does not know go to libFuzzer.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

# heavy modules first, outside the instrumented import: only testbed's own code is instrumented
import msgpack  # noqa: F401
import torch  # noqa: F401

from campaign import Campaign, printable_error  # noqa: E402  (this folder)

MAX_INPUT = 64 * 1024


def wire_check(decode, wire_error, messages):
    """Measured: a message of a known kind, or a printable WireError (None)."""
    def check(data: bytes):
        try:
            msg = decode(data)
        except wire_error as e:
            printable_error(str(e))
            return None
        if type(msg) not in messages.values():
            raise AssertionError(f"decoded to {type(msg).__name__}, not a message kind")
        return msg
    return check


def round_trip(decode, encode):
    """Unmeasured (msgpack's packer buffer is 256 KiB): the message survives its own encoding."""
    def verify(msg) -> None:
        if decode(encode(msg)) != msg:
            raise AssertionError(f"a '{msg.kind}' does not survive its own encoding")
    return verify


def seed_corpus(directory: Path, encode) -> None:
    """Every message kind, encoded (the examples tests/test_wire.py round-trips)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
    from test_wire import EXAMPLES
    directory.mkdir(parents=True, exist_ok=True)
    for i, msg in enumerate(EXAMPLES):
        (directory / f"seed-{i}-{msg.kind}").write_bytes(encode(msg))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=5.0, help="how long to fuzz")
    ap.add_argument("--work-dir", type=Path, default=Path("outputs/fuzz_wire"), help="corpus/ and crashes/ go here")
    args, libfuzzer_args = ap.parse_known_args()

    import atheris
    with atheris.instrument_imports(include=["testbed"]):
        from testbed.runtime.messages import MESSAGES
        from testbed.runtime.wire import WireError, decode, encode

    corpus = args.work_dir / "corpus"
    seed_corpus(corpus, encode)
    campaign = Campaign("fuzz_wire", args.work_dir / "crashes", args.minutes * 60,
                        wire_check(decode, WireError, MESSAGES), round_trip(decode, encode))
    campaign.warm(corpus)
    atheris.Setup([sys.argv[0], f"-max_len={MAX_INPUT}", *libfuzzer_args, str(corpus)], campaign.one_input)
    atheris.Fuzz()


if __name__ == "__main__":
    main()
