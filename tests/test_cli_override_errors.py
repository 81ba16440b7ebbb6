"""A property of the command line: every bad override (a wrong type, a
number out of range, an unknown field, an unknown group or preset) stops
`testbed run` with exit status 2 and one line on stderr that names the field
and what would be right; nothing is run.

The CLI runs in this process (testbed.cli.main) for speed. Every case adds
runtime=sim and one request, so an override that wrongly got through would
show up as a finished (cheap) run rather than a minute of real workers.
"""
from __future__ import annotations

import contextlib
import dataclasses
import io
import sys
import tempfile
import typing
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from testbed.cli import main
from testbed.config import RunConfig
from testbed.model.config import CONF_DIR

GROUPS = sorted(p.name for p in CONF_DIR.iterdir() if p.is_dir())
# words Hydra or OmegaConf read as something other than a string
NOT_WORDS = {"true", "false", "null", "none", "yes", "no", "on", "off", "y", "n", "inf", "nan", "infinity"}


def _scalar_fields(cls=RunConfig, prefix: str = ""):
    """(dotted name, type) of every int, float and bool field under RunConfig."""
    for f, hint in zip(dataclasses.fields(cls), typing.get_type_hints(cls).values()):
        args = [a for a in typing.get_args(hint) if a is not type(None)] or [hint]
        base = args[0] if len(args) == 1 else None
        if dataclasses.is_dataclass(base):
            yield from _scalar_fields(base, f"{prefix}{f.name}.")
        elif base in (int, float, bool):
            yield f"{prefix}{f.name}", base


def _field_names(cls) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


SCALARS = sorted(_scalar_fields())
SECTIONS = {f.name: typing.get_type_hints(RunConfig)[f.name] for f in dataclasses.fields(RunConfig)
            if dataclasses.is_dataclass(typing.get_type_hints(RunConfig)[f.name])}
# fields whose valid values start at 1 (counts) or above 0 (rates, times)
AT_LEAST_ONE = ["token_budget", "max_num_seqs", "max_num_batched_tokens", "num_kv_blocks", "block_size",
                "replicas", "prefill_workers", "decode_workers", "torch_threads", "workload.prompt_len"]
ABOVE_ZERO = ["timeout_s", "workload.rate", "workload.time_scale", "workload.burstiness", "transfer.timeout_s",
              "transfer.rate_gbps"]
NAMED_CHOICES = ["mode", "scheduler", "router", "transfer.transport", "workload.arrival", "workload.prompt_dist",
                 "workload.trace_format", "wandb.mode"]

identifier = st.from_regex(r"[a-z][a-z0-9_]{0,10}", fullmatch=True).filter(lambda w: w not in NOT_WORDS)
word = st.from_regex(r"[A-Za-z][A-Za-z0-9_]{0,8}", fullmatch=True).filter(lambda w: w.lower() not in NOT_WORDS)


@st.composite
def wrong_type(draw):
    name, kind = draw(st.sampled_from(SCALARS))
    if kind is int and draw(st.booleans()):
        value = repr(draw(st.floats(-1e6, 1e6).filter(lambda x: not x.is_integer())))
    else:
        value = draw(word)
    return f"{name}={value}", [name, "e.g."]


@st.composite
def out_of_range(draw):
    if draw(st.booleans()):
        name, value = draw(st.sampled_from(AT_LEAST_ONE)), str(draw(st.integers(-10**12, 0)))
    else:
        name, value = draw(st.sampled_from(ABOVE_ZERO)), repr(draw(st.floats(-1e9, 0.0)))
    return f"{name}={value}", [name, "must be"]


@st.composite
def unknown_name(draw):
    plus = draw(st.sampled_from(["", "+", "++"]))
    if draw(st.booleans()):
        key = draw(identifier.filter(lambda k: k not in _field_names(RunConfig) and k not in GROUPS
                                     and k != "hydra"))
    else:
        section = draw(st.sampled_from(sorted(SECTIONS)))
        key = f"{section}.{draw(identifier.filter(lambda k: k not in _field_names(SECTIONS[section])))}"
    return f"{plus}{key}={draw(word)}", [key, "no such field"]


@st.composite
def unknown_choice(draw):
    if draw(st.booleans()):       # a preset a group does not have
        group = draw(st.sampled_from([g for g in GROUPS if g != "experiment"]))
        choice = draw(identifier.filter(lambda c: not (CONF_DIR / group / f"{c}.yaml").exists()))
        return f"{group}={choice}", [f"{group}='{choice}'", "choose one of"]
    name = draw(st.sampled_from(NAMED_CHOICES))     # a policy or option name nothing registers
    choice = draw(identifier.filter(lambda c: c not in {"colocated", "disagg", "sarathi", "orca", "vllm_v0",
                                                        "request_level", "round_robin", "least_outstanding",
                                                        "zmq", "torch_dist", "shaped", "poisson", "gamma",
                                                        "constant", "burst", "trace", "fixed", "uniform",
                                                        "lognormal", "zipf", "azure", "mooncake", "sarathi_csv",
                                                        "jsonl", "offline", "online", "disabled"}))
    return f"{name}={choice}", [name, choice]


def run_cli(override: str) -> tuple[int, list[str], Path]:
    """testbed run OVERRIDE in this process: (exit status, stderr lines, run dir)."""
    err = io.StringIO()
    argv = sys.argv[:]
    with tempfile.TemporaryDirectory() as tmp, contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["run", "runtime=sim", "workload.num_requests=1", "wandb.mode=disabled",
                         "progress=false", f"hydra.run.dir={tmp}", override])
        except SystemExit as e:
            code = e.code
        finally:
            sys.argv = argv
        ran = (Path(tmp) / "summary.json").exists()
    return code, err.getvalue().strip().splitlines(), ran


BAD_OVERRIDES = st.one_of(wrong_type(), out_of_range(), unknown_name(), unknown_choice())


def check_refused(case) -> None:
    override, fragments = case
    code, lines, ran = run_cli(override)
    assert code == 2, (override, code, lines)
    assert len(lines) == 1, (override, lines)
    assert lines[0].startswith("error: "), lines
    for fragment in fragments:
        assert fragment in lines[0], (override, fragment, lines[0])
    assert not ran


# Hydra composes the config in ~1 s per call here, so the default run draws 16
# cases; `pytest -m slow` draws 300.
@settings(max_examples=16, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BAD_OVERRIDES)
def test_every_bad_override_is_one_line_naming_the_field_and_exit_2(case):
    check_refused(case)


@pytest.mark.slow
@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(BAD_OVERRIDES)
def test_every_bad_override_is_one_line_naming_the_field_and_exit_2_many(case):
    check_refused(case)


@pytest.mark.parametrize("override, message", [
    ("token_budget=abc", "error: token_budget: must be an integer >= 1 or 'auto', got 'abc'"),
    ("enable_prefix_caching=maybe", "error: enable_prefix_caching='maybe' is not true or false; write it as "
                                    "e.g. enable_prefix_caching=true"),
    ("workload.max_requests=1.5", "error: workload.max_requests=1.5 is not a whole number or null"),
    ("workload.inject_arrival_s=abc", "is not a list of numbers in brackets; write it as e.g. "
                                      "workload.inject_arrival_s=[1.0,1.0]"),
    ("transfer=5", "error: transfer is a group of fields (TransferConfig), not one value; set a field of it, "
                   "e.g. transfer.transport=zmq"),
    ("token_budgt=512", "error: token_budgt: no such field in the run config; did you mean token_budget?"),
    ("workload.rat=2", "error: workload.rat: no such field in workload (WorkloadConfig); "
                       "did you mean workload.rate?"),
    ("+foo=1", "error: foo: no such field in the run config"),
    ("token_budget=[1", "error: cannot read the override 'token_budget=[1'"),
    ("hydra/launcher=nope", "error: hydra/launcher='nope' is not a known preset; choose one of: basic"),
    ("model=llama-nope", "error: model='llama-nope' is not a known preset (conf/model/); choose one of:"),
])
def test_override_errors_read_like_this(override, message):
    code, lines, ran = run_cli(override)
    assert (code, len(lines), ran) == (2, 1, False), lines
    assert message in lines[0]


def test_a_good_appended_override_still_runs():
    """`++` on a field the schema has is Hydra's way to set-or-add: allowed."""
    code, lines, ran = run_cli("++token_budget=64")
    assert code == 0 and ran, lines
