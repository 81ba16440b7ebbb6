"""ExperimentConfig: the `experiment` node of the run config. Empty `name`
means a plain run; otherwise `testbed run experiment=NAME` runs that study
(conf/experiment/NAME.yaml sets these values; `NAME-full` is the long sweep).
One flat dataclass: each study reads the fields it needs."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

EXPERIMENTS = ("crossover", "capacity", "stall", "chunk_overhead", "hybrid_batch", "decision")
DECISION_COLOCATED = ("sarathi", "adaptive")


@dataclass
class ExperimentConfig:
    name: str | None = None
    variant: str = "default"                 # default | full | real (decision-real: the real engine too)
    # the simulator's grid
    models: list[str] = field(default_factory=lambda: ["llama3-8b", "llama2-70b", "yi-34b", "llama2-7b",
                                                       "deepseek-v2-lite"])
    hardware: list[str] = field(default_factory=lambda: ["a100-80gb-sxm", "h100-sxm", "h200"])
    links: list[str] = field(default_factory=lambda: ["tcp-25", "rdma-100", "rdma-200", "rdma-400", "nvlink"])
    chunk_sizes: list[int] = field(default_factory=lambda: [256, 512, 1024, 2048, 4096, 8192])
    context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536,
                                                             131072, 262144, 524288, 1048576])
    # the real engine on this machine
    real: bool = True
    real_models: list[str] = field(default_factory=lambda: ["tiny", "mid"])
    real_context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    real_chunk_sizes: list[int] = field(default_factory=lambda: [512, 2048])
    real_transports: list[str] = field(default_factory=lambda: ["zmq", "torch_dist"])
    real_link_gbps: list[float] = field(default_factory=lambda: [25.0])   # shaped links emulated on loopback
    real_max_tokens: int = 32768             # the largest prompt the real engine prefills here
    # serving studies (capacity, stall)
    schedulers: list[str] = field(default_factory=lambda: ["vllm_v0", "orca", "sarathi"])
    token_budgets: list[int] = field(default_factory=lambda: [512, 2048])
    disagg_splits: list[str] = field(default_factory=lambda: ["1P1D"])
    disagg_scheduler: str = "vllm_v0"        # both pools of a disagg point: whole prefills, as in Splitwise
    # capacity: name -> {preset: a conf/workload name (optional), slo: {ttft_ms, tbt_ms},
    # workload: WorkloadConfig fields over the preset}; conf/experiment/capacity.yaml sets them
    capacity_workloads: dict[str, Any] = field(default_factory=dict)
    capacity_rate_start: float = 1.0         # requests/s per GPU where the search starts doubling or halving
    capacity_rel_tol: float = 0.1            # stop when the bracket's hi/lo - 1 is below this
    capacity_max_probes: int = 10            # runs per search at most
    # capacity's real-engine point: steady-state probes (testbed/steady_state.py), at most this many requests
    capacity_span_factor: float = 10.0
    capacity_min_judged: int = 20
    capacity_max_requests: int = 400
    real_capacity_policies: list[str] = field(default_factory=lambda: ["sarathi"])
    real_capacity_workload: dict[str, Any] = field(default_factory=dict)
    # prefill studies (chunk_overhead, hybrid_batch)
    num_decodes: int = 16                    # hybrid_batch: running decodes in every batch
    decode_context_len: int = 1024           # hybrid_batch, crossover's piggyback tax: each decode's context D
    piggyback_decodes: list[int] = field(default_factory=lambda: [0, 8, 32, 128])  # crossover: decodes B per batch
    repeats: int = 3                         # timing repetitions per real measurement
    # decision (testbed/experiments/decision.py): models x hardware x links x num_gpus x context_lens
    decision_num_gpus: list[int] = field(default_factory=lambda: [2])
    decision_tbt_slos_ms: list[int] = field(default_factory=lambda: [50, 100])
    decision_smoothness: list[str] = field(default_factory=lambda: ["p99_tbt", "fluidity"])
    decision_fluidity_min: float = 0.99
    decision_ttft_k: float = 5.0             # TTFT SLO = k x one GPU's whole-prefill time of an L prompt
    decision_output_len: int = 128
    decision_prompt_sigma: float = 0.1       # lognormal shape of the prompt lengths around L
    decision_reuse: float = 0.0              # > 0: multi-turn prompts reusing this share; adds kvstore
    decision_turns: int = 2                  # turns per conversation when decision_reuse > 0
    decision_colocated: list[str] = field(default_factory=lambda: ["sarathi", "adaptive"])
    # deployment labels to study (sarathi-512, adaptive, disagg-1P1D, ...); empty: every one.
    # Re-runs one row (e.g. [adaptive]) without the others' probes
    decision_deployments: list[str] = field(default_factory=list)
    decision_tp: dict[str, int] = field(default_factory=dict)   # model name -> tp (default: the run's parallel.tp)
    # hardware name -> KV blocks per worker (default: num_kv_blocks=auto, the hardware's). On cpu-2w
    # auto is 2,048 blocks, 32K tokens: past L = 32K half the prompts never fit and every probe fails.
    # A new key takes Hydra's '+': +experiment.decision_kv_blocks.cpu-2w=8192
    decision_kv_blocks: dict[str, int] = field(default_factory=dict)
    decision_pool_tp: list[int] = field(default_factory=lambda: [1, 2, 4, 8])   # disagg: each pool's tp searched
    decision_span_factor: float = 10.0       # steady state: arrivals span this many longest service times
    decision_min_judged: int = 20            # steady state: requests judged per probe at least
    # a probe's requests at most, per GPU of the deployment: its arrival rate, and so the requests a span of
    # span_factor service times takes, grow with N (a flat 4,000 left N = 8's colocated probes unsteady to 8K)
    decision_max_requests_per_gpu: int = 2000
    # a directory where simulated probes are kept, so that a grid cut short resumes (probe_cache.py); "": none
    probe_cache: str = ""
    # decision's real-engine rows (real=true, decision_real.py): real_models x real_context_lens on this CPU
    decision_real_num_gpus: int = 2          # worker processes, one per GPU of the deployment
    # the `testbed profile` of this CPU pricing the real rows' simulated twins; measure it with
    # --workers decision_real_num_gpus (the workers step at once near capacity: issue 20)
    decision_real_hardware: str = "cpu"
    decision_real_probe_s: float = 60.0      # a real probe's arrivals span at most this; its drain as long
    decision_real_budget_s: float = 1500.0   # wall time of all real rows; once spent, the rest are flagged
    decision_real_rel_tol: float = 0.25      # the real searches' bracket (each probe is a minute of wall time)
    decision_real_max_probes: int = 5

    def validate(self) -> None:
        if self.name is not None and self.name not in EXPERIMENTS:
            raise ValueError(f"experiment.name='{self.name}' is not known; choose one of: {', '.join(EXPERIMENTS)}")
        for f in ("chunk_sizes", "context_lens", "real_context_lens", "real_chunk_sizes", "token_budgets"):
            if any(v < 1 for v in getattr(self, f)):
                raise ValueError(f"experiment.{f}: every value must be >= 1, got {getattr(self, f)}")
        for f in ("num_decodes", "decode_context_len"):
            if getattr(self, f) < 1:
                raise ValueError(f"experiment.{f}: must be >= 1, got {getattr(self, f)}")
        if not self.piggyback_decodes or any(b < 0 for b in self.piggyback_decodes):
            raise ValueError(f"experiment.piggyback_decodes: a non-empty list of decode counts >= 0, got "
                             f"{self.piggyback_decodes}")
        if self.capacity_rate_start <= 0:
            raise ValueError(f"experiment.capacity_rate_start: must be > 0, got {self.capacity_rate_start}")
        if not 0 < self.capacity_rel_tol < 1:
            raise ValueError(f"experiment.capacity_rel_tol: a fraction in (0, 1), got {self.capacity_rel_tol}")
        if self.capacity_max_probes < 2:
            raise ValueError(f"experiment.capacity_max_probes: at least 2 to bracket a rate, got "
                             f"{self.capacity_max_probes}")
        if not self.capacity_span_factor > 2:
            raise ValueError(f"experiment.capacity_span_factor: must be > 2 (warm-up and drain each take one "
                             f"longest service time), got {self.capacity_span_factor}")
        if self.capacity_min_judged < 1 or self.capacity_max_requests < self.capacity_min_judged:
            raise ValueError(f"experiment.capacity_max_requests: need capacity_max_requests >= capacity_min_judged"
                             f" >= 1, got {self.capacity_max_requests} and {self.capacity_min_judged}")
        for s in self.disagg_splits:
            parse_split(s)
        if self.repeats < 1:
            raise ValueError(f"experiment.repeats: must be >= 1, got {self.repeats}")
        self._validate_decision()

    def _validate_decision(self) -> None:
        def bad(name: str, why: str) -> ValueError:
            return ValueError(f"experiment.{name}: {why}")
        for f in ("decision_num_gpus", "decision_tbt_slos_ms"):
            if not getattr(self, f) or any(v < 1 for v in getattr(self, f)):
                raise bad(f, f"give one or more values >= 1, got {getattr(self, f)}")
        from testbed.experiments.decision_slo import SMOOTHNESS
        unknown = [s for s in self.decision_smoothness if s not in SMOOTHNESS]
        if unknown or not self.decision_smoothness:
            raise bad("decision_smoothness", f"{unknown or 'empty'}: choose from {', '.join(SMOOTHNESS)}")
        unknown = [s for s in self.decision_colocated if s not in DECISION_COLOCATED]
        if unknown:
            raise bad("decision_colocated", f"{unknown} not known: choose from {', '.join(DECISION_COLOCATED)}")
        if not 0 < self.decision_fluidity_min <= 1:
            raise bad("decision_fluidity_min", f"a fraction in (0, 1], got {self.decision_fluidity_min}")
        for f in ("decision_ttft_k", "decision_prompt_sigma"):
            if not getattr(self, f) > 0:
                raise bad(f, f"must be > 0, got {getattr(self, f)}")
        for f in ("decision_output_len", "decision_min_judged"):
            if getattr(self, f) < 1:
                raise bad(f, f"must be >= 1, got {getattr(self, f)}")
        if self.decision_turns < 2:
            raise bad("decision_turns", f"a conversation reuses its prompt from the 2nd turn on: >= 2, got "
                                        f"{self.decision_turns}")
        if not 0 <= self.decision_reuse < 1:
            raise bad("decision_reuse", f"a fraction in [0, 1) (0: no prefix reuse), got {self.decision_reuse}")
        if not self.decision_span_factor > 2:
            raise bad("decision_span_factor", f"must be > 2 (warm-up and drain each take one longest service "
                                              f"time), got {self.decision_span_factor}")
        fewest = self.decision_max_requests_per_gpu * min(self.decision_num_gpus, default=1)
        if fewest < self.decision_min_judged:
            raise bad("decision_max_requests_per_gpu", f"{self.decision_max_requests_per_gpu} x the fewest GPUs "
                                                       f"({min(self.decision_num_gpus, default=1)}) = {fewest} is "
                                                       f"below decision_min_judged={self.decision_min_judged}")
        if not self.decision_pool_tp or any(t < 1 for t in self.decision_pool_tp):
            raise bad("decision_pool_tp", f"give one or more tp values >= 1, got {self.decision_pool_tp}")
        for f in ("decision_real_probe_s", "decision_real_budget_s"):
            if not getattr(self, f) > 0:
                raise bad(f, f"seconds, must be > 0, got {getattr(self, f)}")
        if not 0 < self.decision_real_rel_tol < 1:
            raise bad("decision_real_rel_tol", f"a fraction in (0, 1), got {self.decision_real_rel_tol}")
        for f in ("decision_real_max_probes", "decision_real_num_gpus"):
            if getattr(self, f) < (2 if f == "decision_real_max_probes" else 1):
                raise bad(f, f"too small: {getattr(self, f)} (probes: at least 2 to bracket a rate; GPUs >= 1)")
        bad_tp = {m: tp for m, tp in self.decision_tp.items() if not isinstance(tp, int) or tp < 1}
        if bad_tp:
            raise bad("decision_tp", f"model name -> tp >= 1, got {bad_tp}")
        bad_kv = {h: n for h, n in self.decision_kv_blocks.items() if not isinstance(n, int) or n < 1}
        if bad_kv:
            raise bad("decision_kv_blocks", f"hardware name -> KV blocks per worker >= 1, got {bad_kv}")
        studied = set(self.hardware) | {self.decision_real_hardware}
        unknown = sorted(set(self.decision_kv_blocks) - studied)
        if unknown:
            raise bad("decision_kv_blocks", f"{unknown} is no hardware of this study (experiment.hardware "
                      f"{list(self.hardware)}, decision_real_hardware {self.decision_real_hardware})")


def parse_split(split: str) -> tuple[int, int]:
    """'2P1D' -> (2, 1): prefill and decode workers of a disaggregated point."""
    import re
    m = re.fullmatch(r"(\d+)P(\d+)D", split)
    if not m or int(m[1]) < 1 or int(m[2]) < 1:
        raise ValueError(f"experiment.disagg_splits: '{split}' is not of the form xPyD with x, y >= 1 (e.g. 1P1D)")
    return int(m[1]), int(m[2])
