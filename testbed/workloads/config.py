"""WorkloadConfig: what requests a run serves and when they arrive.

The `workload` Hydra group (conf/workload/NAME.yaml) sets values of this
dataclass; every default lives here. `build_workload` (build.py) turns it into
the list of `Request`s the frontend releases at their `arrival_s`.

Three sources of shape, combined per request:
- arrivals: a process by name (`poisson`, `gamma`, `constant`, `burst`) or the
  trace's own timestamps (`trace`); `time_scale` stretches every arrival time;
- lengths: per side (prompt, output) a distribution by name (`fixed`,
  `uniform`, `lognormal`, `zipf`) or the trace's value (`trace`);
- injected requests: explicit (arrival, prompt length, output length) triples
  added on top, for scripted events such as a long prompt landing among decodes.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields
from pathlib import Path

from omegaconf import OmegaConf

from testbed.model.config import CONF_DIR

# Names the registries in arrivals.py / lengths.py / readers.py answer to; kept
# here as plain tuples so validation does not import numpy-heavy modules.
ARRIVAL_KINDS = ("poisson", "gamma", "constant", "burst", "trace")
LENGTH_KINDS = ("fixed", "uniform", "lognormal", "zipf", "trace")
TRACE_FORMATS = ("azure", "mooncake", "sarathi_csv", "jsonl", "otel")
TRACE_FORMATS_WITHOUT_TIMESTAMPS = ("sarathi_csv",)

# Relative trace paths are resolved against the repository root, never the cwd
# (Hydra may chdir into the run directory).
REPO_ROOT = CONF_DIR.parent


@dataclass
class WorkloadConfig:
    name: str = "mixed"
    num_requests: int = 32                 # synthetic requests (a trace gives its own count)

    # arrivals
    arrival: str = "poisson"               # poisson | gamma | constant | burst | trace
    rate: float = 1.0                      # requests/s (poisson, gamma, constant)
    burstiness: float = 1.0                # gamma shape (vLLM benchmark): 1 = Poisson, <1 burstier
    time_scale: float = 1.0                # every arrival time is multiplied by this (0.25: 4x faster)

    # prompt lengths: fixed uses prompt_len; uniform draws in [prompt_min, prompt_max];
    # lognormal has median prompt_len and shape prompt_sigma, clipped to [min, max];
    # zipf gives value prompt_min + r - 1 probability ~ r^-prompt_zipf_a (rank r >= 1) up to max
    prompt_dist: str = "uniform"           # fixed | uniform | lognormal | zipf | trace
    prompt_len: int = 256
    prompt_min: int = 32
    prompt_max: int = 1024
    prompt_sigma: float = 1.0
    prompt_zipf_a: float = 1.2

    # output lengths (max_tokens), same kinds and parameters
    output_dist: str = "uniform"
    output_len: int = 64
    output_min: int = 16
    output_max: int = 128
    output_sigma: float = 1.0
    output_zipf_a: float = 1.2

    # trace replay
    trace_path: str | None = None          # absolute, or relative to the repository root or trace_dataset
    trace_dataset: str | None = None       # a dataset's name (`testbed data list`): trace_path is a file of it
    trace_format: str = "azure"            # azure | mooncake | sarathi_csv | jsonl | otel
    hash_block_size: int = 512             # tokens per mooncake hash_ids block

    # multi-turn chat (multiturn.py): conversations of this many turns; 0: single requests
    conversation_turns: int = 0
    reuse_fraction: float = 0.6            # each later turn's share that is the previous prompt
    think_time_s: float = 5.0              # mean gap between a conversation's turns

    # clipping (None: no limit)
    max_requests: int | None = None        # keep the first N trace rows / synthetic requests
    max_prompt_len: int | None = None      # longer prompts are truncated to this
    max_output_len: int | None = None      # larger max_tokens are lowered to this

    # injected requests: element i is one request at inject_arrival_s[i] (seconds,
    # not scaled) with the given prompt and output lengths
    inject_arrival_s: list[float] = field(default_factory=list)
    inject_prompt_len: list[int] = field(default_factory=list)
    inject_output_len: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.validate()

    @property
    def uses_trace(self) -> bool:
        return self.arrival == "trace" or self.prompt_dist == "trace" or self.output_dist == "trace"

    def resolved_trace_path(self) -> Path:
        if self.trace_path is None:
            raise ValueError("workload.trace_path: not set; give the trace file's path")
        path = Path(self.trace_path).expanduser()
        if self.trace_dataset and not path.is_absolute():
            from testbed.data import dataset_dir
            return dataset_dir(self.trace_dataset, needed_by=f"workload={self.name}") / path
        return path if path.is_absolute() else (REPO_ROOT / path).resolve()

    def validate(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"workload.{name}: {why}")

        def one_of(name: str, allowed: tuple[str, ...]) -> None:
            if getattr(self, name) not in allowed:
                raise bad(name, f"'{getattr(self, name)}' is not one of {', '.join(allowed)}")

        if not self.name:
            raise bad("name", "must not be empty")
        one_of("arrival", ARRIVAL_KINDS)
        one_of("prompt_dist", LENGTH_KINDS)
        one_of("output_dist", LENGTH_KINDS)
        one_of("trace_format", TRACE_FORMATS)
        for name in ("rate", "burstiness", "time_scale", "prompt_sigma", "prompt_zipf_a",
                     "output_sigma", "output_zipf_a"):
            if not getattr(self, name) > 0:
                raise bad(name, f"must be > 0, got {getattr(self, name)}")
        for name in ("prompt_len", "prompt_min", "output_len", "output_min", "hash_block_size"):
            if getattr(self, name) < 1:
                raise bad(name, f"must be >= 1, got {getattr(self, name)}")
        for side in ("prompt", "output"):
            lo, hi = getattr(self, f"{side}_min"), getattr(self, f"{side}_max")
            if hi < lo:
                raise bad(f"{side}_max", f"{hi} is below {side}_min={lo}")
        for name in ("max_requests", "max_prompt_len", "max_output_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise bad(name, f"must be >= 1 or null (no limit), got {value}")
        if self.conversation_turns < 0:
            raise bad("conversation_turns", f"must be >= 0 (0: no conversations), got {self.conversation_turns}")
        if not 0.0 < self.reuse_fraction < 1.0:
            raise bad("reuse_fraction", f"must be in (0, 1), got {self.reuse_fraction}")
        if not self.think_time_s >= 0:
            raise bad("think_time_s", f"must be >= 0, got {self.think_time_s}")
        if self.conversation_turns and self.uses_trace:
            raise bad("conversation_turns", "a multi-turn workload makes its own prompts; it cannot replay a trace")
        if self.num_requests < 0:
            raise bad("num_requests", f"must be >= 0, got {self.num_requests}")
        n_inject = len(self.inject_arrival_s)
        for name in ("inject_prompt_len", "inject_output_len"):
            if len(getattr(self, name)) != n_inject:
                raise bad(name, f"has {len(getattr(self, name))} entries but inject_arrival_s has "
                          f"{n_inject}; give one value per injected request")
        if any(t < 0 for t in self.inject_arrival_s):
            raise bad("inject_arrival_s", f"times must be >= 0, got {list(self.inject_arrival_s)}")
        if any(n < 1 for n in [*self.inject_prompt_len, *self.inject_output_len]):
            raise bad("inject_prompt_len", "injected prompt and output lengths must be >= 1")
        if self.uses_trace:
            path = self.resolved_trace_path()
            if not path.is_file():
                where = f"dataset {self.trace_dataset}" if self.trace_dataset else REPO_ROOT
                raise bad("trace_path", f"{path} does not exist (relative paths start at {where})")
            if self.arrival == "trace" and self.trace_format in TRACE_FORMATS_WITHOUT_TIMESTAMPS:
                raise bad("arrival", f"trace_format={self.trace_format} has no timestamps; "
                          "choose poisson, gamma, constant or burst")
        elif self.num_requests + n_inject < 1:
            raise bad("num_requests", "the workload has no requests; set num_requests >= 1")


def workload_preset_names() -> list[str]:
    return sorted(p.stem for p in (CONF_DIR / "workload").glob("*.yaml"))


def make_workload_config(raw: dict) -> WorkloadConfig:
    """A WorkloadConfig from plain values (a preset's YAML, a Hydra node turned
    into a container); unknown keys are an error, not ignored."""
    known = {f.name for f in fields(WorkloadConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ValueError(f"workload: unknown field(s) {unknown}; known fields are {sorted(known)}")
    return WorkloadConfig(**raw)


def load_workload_preset(name: str, **overrides) -> WorkloadConfig:
    """conf/workload/NAME.yaml as a WorkloadConfig (outside Hydra: tests, benchmarks)."""
    path = CONF_DIR / "workload" / f"{name}.yaml"
    if not path.exists():
        raise ValueError(f"workload='{name}' is not a known preset; choose one of: "
                         f"{', '.join(workload_preset_names())}")
    raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True)
    raw.update(overrides)
    return make_workload_config(raw)
