"""DecisionConfig: `experiment=decision` (decision.py), capacity per GPU
within the SLOs of every deployment on N GPUs as the context length grows,
over models x hardware x links x num_gpus x context_lens on the simulator,
and (real=true) the same deployments on the real engine here
(decision_real.py)."""
from __future__ import annotations

from dataclasses import dataclass, field

from testbed.experiments.config import StudyConfig, at_least, fraction, positive

COLOCATED = ("sarathi", "adaptive")
SWEEP_BY = ("family", "cell")


@dataclass
class DecisionConfig(StudyConfig):
    name: str = "decision"
    run = "testbed.experiments.decision:run_decision"
    models: list[str] = field(default_factory=lambda: ["llama3-8b"])
    hardware: list[str] = field(default_factory=lambda: ["h100-sxm"])
    links: list[str] = field(default_factory=lambda: ["tcp-25", "rdma-100", "rdma-400", "nvlink"])
    num_gpus: list[int] = field(default_factory=lambda: [2])
    context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192, 16384, 32768, 65536,
                                                             131072, 262144, 524288, 1048576])
    tbt_slos_ms: list[int] = field(default_factory=lambda: [100])
    smoothness: list[str] = field(default_factory=lambda: ["p99_tbt", "fluidity"])
    fluidity_min: float = 0.99
    ttft_k: float = 5.0                      # TTFT SLO = k x one GPU's whole-prefill time of an L prompt
    output_len: int = 128
    prompt_sigma: float = 0.1                # lognormal shape of the prompt lengths around L
    reuse: float = 0.0                       # > 0: multi-turn prompts reusing this share; adds kvstore
    turns: int = 2                           # turns per conversation when reuse > 0
    # the deployments: sarathi at each token budget, adaptive, disagg (disagg_scheduler in both pools)
    # at every xPyD split with each pool's tp from pool_tp
    token_budgets: list[int] = field(default_factory=lambda: [512, 2048])
    colocated: list[str] = field(default_factory=lambda: ["sarathi", "adaptive"])
    disagg_scheduler: str = "vllm_v0"
    pool_tp: list[int] = field(default_factory=lambda: [1, 2, 4, 8])
    # deployment labels to study (sarathi-512, adaptive, disagg-1P1D, ...); empty: every one.
    # Re-runs one row (e.g. [adaptive]) without the others' probes
    deployments: list[str] = field(default_factory=list)
    tp: dict[str, int] = field(default_factory=dict)   # model name -> tp (default: the run's parallel.tp)
    # hardware name -> KV blocks per worker (default: num_kv_blocks=auto, the hardware's). On cpu-2w
    # auto is 2,048 blocks, 32K tokens: past L = 32K half the prompts never fit and every probe fails.
    # A new key takes Hydra's '+': +experiment.kv_blocks.cpu-2w=8192
    kv_blocks: dict[str, int] = field(default_factory=dict)
    # the capacity search
    rate_start: float = 8.0                  # requests/s per GPU where the search starts doubling or halving
    rel_tol: float = 0.1                     # stop when the bracket's hi/lo - 1 is below this
    max_probes: int = 10
    # start each search from what the study knows (decision_brackets.py: the neighbouring L's capacity, the
    # family's best in the cell); false: each L from 0.6x the previous L's capacity, every deployment in full
    prior_brackets: bool = True
    # the grid's sweeps (decision_grid.py): family (a colocated deployment alone, a family's link-using
    # ones together: the most sweeps to run at once) or cell (every deployment of a model, hardware and N
    # together: either family's best rules the other's deployments out, the fewest probes)
    sweep_by: str = "family"
    span_factor: float = 10.0                # steady state: arrivals span this many longest service times
    min_judged: int = 20                     # steady state: requests judged per probe at least
    # a probe's requests at most, per GPU of the deployment: its arrival rate, and so the requests a span of
    # span_factor service times takes, grow with N (a flat 4,000 left N = 8's colocated probes unsteady to 8K)
    max_requests_per_gpu: int = 2000
    # the grid's sweeps at once: auto (Ray tasks on a local cluster, one per core this process may run on),
    # N (N Ray workers), or 1 (one after another in this process); with ray.address, tasks on that cluster
    parallel: str = "auto"
    # a directory where simulated probes are kept, so that a grid cut short resumes (probe_cache.py); "": none
    probe_cache: str = ""
    # the real engine's rows (decision_real.py): real_models x real_context_lens on this CPU
    real: bool = False
    real_models: list[str] = field(default_factory=lambda: ["tiny", "mid"])
    real_context_lens: list[int] = field(default_factory=lambda: [1024, 2048, 4096, 8192])
    real_num_gpus: int = 2                   # worker processes, one per GPU of the deployment
    # the `testbed profile` of this CPU pricing the real rows' simulated twins; measure it with
    # --workers real_num_gpus (the workers step at once near capacity)
    real_hardware: str = "cpu"
    real_probe_s: float = 60.0               # a real probe's arrivals span at most this; its drain as long
    real_budget_s: float = 1500.0            # wall time of all real rows; once spent, the rest are flagged
    real_rel_tol: float = 0.25               # the real searches' bracket (each probe is a minute of wall time)
    real_max_probes: int = 5

    def validate(self) -> None:
        super().validate()
        at_least(self, 1, "context_lens", "real_context_lens", "token_budgets", "output_len", "min_judged",
                 "real_num_gpus")
        for f in ("num_gpus", "tbt_slos_ms", "pool_tp"):
            if not getattr(self, f) or any(v < 1 for v in getattr(self, f)):
                raise ValueError(f"experiment.{f}: give one or more values >= 1, got {getattr(self, f)}")
        from testbed.experiments.decision_slo import SMOOTHNESS
        unknown = [s for s in self.smoothness if s not in SMOOTHNESS]
        if unknown or not self.smoothness:
            raise ValueError(f"experiment.smoothness: {unknown or 'empty'}: choose from {', '.join(SMOOTHNESS)}")
        unknown = [s for s in self.colocated if s not in COLOCATED]
        if unknown:
            raise ValueError(f"experiment.colocated: {unknown} not known: choose from {', '.join(COLOCATED)}")
        if not 0 < self.fluidity_min <= 1:
            raise ValueError(f"experiment.fluidity_min: a fraction in (0, 1], got {self.fluidity_min}")
        positive(self, "ttft_k", "prompt_sigma", "rate_start", "real_probe_s", "real_budget_s")
        if self.turns < 2:
            raise ValueError(f"experiment.turns: a conversation reuses its prompt from the 2nd turn on: >= 2, "
                             f"got {self.turns}")
        if not 0 <= self.reuse < 1:
            raise ValueError(f"experiment.reuse: a fraction in [0, 1) (0: no prefix reuse), got {self.reuse}")
        if not self.span_factor > 2:
            raise ValueError(f"experiment.span_factor: must be > 2 (warm-up and drain each take one longest "
                             f"service time), got {self.span_factor}")
        fewest = self.max_requests_per_gpu * min(self.num_gpus)
        if fewest < self.min_judged:
            raise ValueError(f"experiment.max_requests_per_gpu: {self.max_requests_per_gpu} x the fewest GPUs "
                             f"({min(self.num_gpus)}) = {fewest} is below min_judged={self.min_judged}")
        if self.parallel != "auto" and not (self.parallel.isdigit() and int(self.parallel) >= 1):
            raise ValueError(f"experiment.parallel: 'auto', or a number of worker processes >= 1 (1: serially in "
                             f"this process), got '{self.parallel}'")
        if self.sweep_by not in SWEEP_BY:
            raise ValueError(f"experiment.sweep_by: {self.sweep_by!r}: choose from {', '.join(SWEEP_BY)}")
        fraction(self, "rel_tol")
        fraction(self, "real_rel_tol")
        for f in ("max_probes", "real_max_probes"):
            if getattr(self, f) < 2:
                raise ValueError(f"experiment.{f}: at least 2 to bracket a rate, got {getattr(self, f)}")
        bad_tp = {m: tp for m, tp in self.tp.items() if not isinstance(tp, int) or tp < 1}
        if bad_tp:
            raise ValueError(f"experiment.tp: model name -> tp >= 1, got {bad_tp}")
        bad_kv = {h: n for h, n in self.kv_blocks.items() if not isinstance(n, int) or n < 1}
        if bad_kv:
            raise ValueError(f"experiment.kv_blocks: hardware name -> KV blocks per worker >= 1, got {bad_kv}")
        unknown = sorted(set(self.kv_blocks) - set(self.hardware) - {self.real_hardware})
        if unknown:
            raise ValueError(f"experiment.kv_blocks: {unknown} is no hardware of this study (experiment.hardware "
                             f"{list(self.hardware)}, real_hardware {self.real_hardware})")
