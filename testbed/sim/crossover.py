"""The crossover arithmetic: when does the chunk re-read tax of
colocated chunked prefill overtake the transfer tax of shipping the prompt's KV
to a decode pool?

By bytes: a prompt of L = N·C tokens prefilled in N chunks of C makes chunk j
re-read the KV of the j·C tokens before it, kv·C·N(N-1)/2 extra bytes against
HBM; disaggregation ships kv·L bytes over the link. Equal times give
L* = C·(1 + 2·hbm_bw / link_bw): linear in the chunk size and in the
bandwidth ratio.

By time: the cost model prices the chunked and the whole prefill (their
difference is the re-read tax in seconds, including the weights re-streamed per
chunk and the per-iteration overheads), the link model prices the transfer,
whole or streamed layer by layer behind the prefill's compute.

Piggybacked (the essay's argument for why chunking is nearly free): in a
loaded colocated system each chunk rides in an iteration with B running
decodes that stream the weights anyway, so what a chunk costs is what it adds
to that iteration. The piggyback tax of a prompt is
    sum over chunks j of [t(B decodes + chunk j) - t(B decodes)] - t(whole prefill alone),
which at B = 0 is the isolated tax above, and falls as B grows because the
weights re-streamed per chunk stop counting against the prompt.

The experiment (conf/experiment/crossover) sweeps these functions; this module
has no I/O."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from testbed.sim.cost_model import CostModel
from testbed.sim.link_model import LinkModel


def _check(context_len: int, chunk_size: int) -> None:
    if context_len < 1 or chunk_size < 1:
        raise ValueError(f"context_len and chunk_size: must be >= 1, got {context_len}, {chunk_size}")


def reread_bytes(kv_bytes_per_token: int, context_len: int, chunk_size: int) -> int:
    """Extra KV bytes read because the prompt was chunked: chunk j (starting at
    token j·C) reads the j·C tokens before it again, for j < N = ceil(L/C).
    Exactly kv·C·N(N-1)/2; a short last chunk still re-reads its whole prefix."""
    _check(context_len, chunk_size)
    n = -(-context_len // chunk_size)
    return kv_bytes_per_token * chunk_size * n * (n - 1) // 2


def transfer_bytes(kv_bytes_per_token: int, context_len: int) -> int:
    """The prompt's whole KV, what disaggregation ships to the decode worker."""
    return kv_bytes_per_token * context_len


def closed_form_crossover(chunk_size: int, hbm_bw: float, link_bw: float) -> float:
    """L* = C·(1 + 2·hbm_bw/link_bw), from kv·C·N(N-1)/2 / hbm_bw = kv·N·C / link_bw
    (both bandwidths in the same unit)."""
    if hbm_bw <= 0 or link_bw <= 0:
        raise ValueError(f"hbm_bw and link_bw: must be > 0, got {hbm_bw}, {link_bw}")
    return chunk_size * (1.0 + 2.0 * hbm_bw / link_bw)


def first_crossing(lengths: Sequence[float], reread: Sequence[float], transfer: Sequence[float]) -> float | None:
    """The smallest context length where the re-read tax reaches the transfer
    tax, interpolated linearly between the grid points around the sign change;
    None if it never does within `lengths` (ascending)."""
    x = np.asarray(lengths, dtype=np.float64)
    diff = np.asarray(reread, dtype=np.float64) - np.asarray(transfer, dtype=np.float64)
    hits = np.flatnonzero(diff >= 0)
    if hits.size == 0:
        return None
    i = int(hits[0])
    if i == 0:
        return float(x[0])
    return float(x[i - 1] + (x[i] - x[i - 1]) * -diff[i - 1] / (diff[i] - diff[i - 1]))


def crossover_by_bytes(kv_bytes_per_token: int, chunk_size: int, hbm_bw: float, link_bw: float,
                       max_context_len: int = 1 << 20) -> float | None:
    """L* by scanning prompt lengths (multiples of the chunk size up to
    max_context_len): re-read bytes over HBM bandwidth against transfer bytes
    over link bandwidth. None if they do not cross in range."""
    lengths = np.arange(chunk_size, max_context_len + 1, chunk_size, dtype=np.int64)
    n = lengths // chunk_size
    reread = kv_bytes_per_token * chunk_size * n * (n - 1) / 2 / hbm_bw
    transfer = kv_bytes_per_token * lengths / link_bw
    return first_crossing(lengths, reread, transfer)


@dataclass
class CrossoverPoint:
    """One row of crossover.csv."""
    model: str
    hardware: str
    link: str
    chunk_size: int
    context_len: int
    reread_bytes: int
    transfer_bytes: int
    chunked_prefill_ms: float
    whole_prefill_ms: float
    reread_ms: float
    transfer_ms: float
    exposed_transfer_ms: float


def chunked_prefill_s(cost: CostModel, context_len: int, chunk_size: int) -> float:
    """A prompt prefilled alone in chunks of chunk_size, one iteration each;
    only the last chunk samples a token."""
    chunks = chunk_slices(context_len, chunk_size)
    return sum(cost.iteration_time_s([piece], num_sampled=int(j == len(chunks) - 1)) for j, piece in enumerate(chunks))


def chunk_slices(context_len: int, chunk_size: int) -> list[tuple[int, int]]:
    """(new tokens, context after the chunk) of each chunk of a prompt prefilled in chunks."""
    _check(context_len, chunk_size)
    return [(min(chunk_size, context_len - start), min(start + chunk_size, context_len))
            for start in range(0, context_len, chunk_size)]


def piggyback_tax_s(cost: CostModel, context_len: int, chunk_size: int, num_decodes: int,
                    decode_context_len: int) -> float:
    """The chunk tax inside a decode batch: each chunk's added time to an
    iteration of `num_decodes` decodes at context `decode_context_len`, summed,
    minus the whole prefill alone. num_decodes = 0 gives the isolated tax
    (chunked_prefill_s minus the whole prefill)."""
    if num_decodes < 0 or decode_context_len < 1:
        raise ValueError(f"num_decodes >= 0 and decode_context_len >= 1, got {num_decodes}, {decode_context_len}")
    decodes = [(1, decode_context_len)] * num_decodes
    base = cost.iteration_time_s(decodes, num_sampled=num_decodes) if num_decodes else 0.0
    chunks = chunk_slices(context_len, chunk_size)
    added = sum(cost.iteration_time_s(decodes + [piece], num_sampled=num_decodes + int(j == len(chunks) - 1)) - base
                for j, piece in enumerate(chunks))
    return added - cost.iteration_time_s([(context_len, context_len)], num_sampled=1)


def crossover_point(cost: CostModel, link: LinkModel, chunk_size: int, context_len: int,
                    messages_per_layer: int = 1, chunked_s: float | None = None) -> CrossoverPoint:
    """Both taxes for one prompt. The KV goes over one link per model replica,
    one message per layer (`messages_per_layer` for per-block sends), either
    after the prefill (transfer_ms) or streamed as each layer finishes
    (exposed_transfer_ms: the part left after the last layer). `chunked_s`:
    chunked_prefill_s already computed for this prompt (it does not depend on the link)."""
    kv, layers = cost.model.kv_bytes_per_token, cost.model.num_layers
    whole = cost.breakdown([(context_len, context_len)], num_sampled=1)
    chunked = chunked_prefill_s(cost, context_len, chunk_size) if chunked_s is None else chunked_s
    nbytes = transfer_bytes(kv, context_len)
    per_layer_compute = (whole["total_s"] - whole["overhead_s"] - whole["lm_head_s"]) / layers
    return CrossoverPoint(
        model=cost.model.name, hardware=cost.hardware.name, link=link.link.name,
        chunk_size=chunk_size, context_len=context_len,
        reread_bytes=reread_bytes(kv, context_len, chunk_size), transfer_bytes=nbytes,
        chunked_prefill_ms=chunked * 1e3, whole_prefill_ms=whole["total_s"] * 1e3,
        reread_ms=(chunked - whole["total_s"]) * 1e3,
        transfer_ms=link.transfer_time_s(nbytes, layers * messages_per_layer) * 1e3,
        exposed_transfer_ms=link.layerwise_exposed_s(per_layer_compute, nbytes / layers, layers,
                                                     messages_per_layer) * 1e3)


def crossover_by_time(points: Sequence[CrossoverPoint], against: str = "transfer_ms",
                      taxes: Sequence[float] | None = None) -> float | None:
    """L* by time over the points of one (model, hardware, link, chunk size):
    where the chunk tax (reread_ms, or `taxes` in ms aligned with `points`, e.g.
    a piggyback tax) reaches `against` (transfer_ms, or exposed_transfer_ms for
    layer-wise streaming). None if not in range."""
    if against not in ("transfer_ms", "exposed_transfer_ms"):
        raise ValueError(f"against: '{against}' is not one of transfer_ms, exposed_transfer_ms")
    taxes = [p.reread_ms for p in points] if taxes is None else list(taxes)
    if len(taxes) != len(points):
        raise ValueError(f"taxes: {len(taxes)} values for {len(points)} points")
    order = sorted(range(len(points)), key=lambda i: points[i].context_len)
    return first_crossing([points[i].context_len for i in order], [taxes[i] for i in order],
                          [getattr(points[i], against) for i in order])
