"""How a prompt's KV is spread over the GPUs of a model replica, and so how
many NICs carry it in parallel from a prefill replica to a decode replica of
a different parallel config (runtime=sim's KV hand-off, runtime/sim.py).

The model: tensor parallelism shards the KV by KV heads, so each of
min(tp, num_kv_heads) GPUs holds a distinct slice (with more GPUs than KV
heads, heads are replicated and the copies add no new bytes); MLA's latent
KV is not split by heads and every TP rank holds all of it. Pipeline
parallelism splits it by layers over pp stages. Each GPU has its own NIC (a
DGX), so the `kv_slices` holders of a replica send (or receive) at once.

Between pools of different layouts the KV is re-sharded on the way: every
byte goes from the one prefill GPU that holds it to the one decode GPU that
needs it, with no gather in between. With P slices on the prefill side and D
on the decode side, each prefill NIC sends 1/P of the bytes and each decode
NIC receives 1/D of them; the busiest NIC carries 1/min(P, D), so the
hand-off takes as long as min(P, D) links in parallel. E.g. prefill tp=2,
decode tp=1: both prefill GPUs send their half into the decode GPU's one
NIC, which carries all of it (1 link). A decode replica with more GPUs than
KV heads (or MLA at tp > 1) copies the replicated heads inside itself over
its NVLink rather than having them sent twice."""
from __future__ import annotations

from testbed.model.config import ModelConfig
from testbed.sim.config import ParallelConfig


def kv_slices(model: ModelConfig, parallel: ParallelConfig) -> int:
    """GPUs of one replica that hold a distinct part of a prompt's KV."""
    by_heads = 1 if model.attention == "mla" else min(parallel.tp, model.num_kv_heads)
    return by_heads * min(parallel.pp, model.num_layers)


def handoff_links(model: ModelConfig, prefill: ParallelConfig, decode: ParallelConfig) -> int:
    """Links that carry a prefill -> decode hand-off in parallel."""
    return min(kv_slices(model, prefill), kv_slices(model, decode))
