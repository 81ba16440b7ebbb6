"""Workloads: which requests a run serves and when they arrive (the first
step of README.md, "Architecture"). `build_workload(cfg, vocab_size, seed)` is the
entry point; config.py holds WorkloadConfig, and arrivals, lengths, readers and
tokens hold the policies it combines."""
from testbed.workloads.build import build_workload
from testbed.workloads.config import WorkloadConfig, load_workload_preset, make_workload_config
from testbed.workloads.tokens import SyntheticTokens

__all__ = ["WorkloadConfig", "SyntheticTokens", "build_workload", "load_workload_preset", "make_workload_config"]
