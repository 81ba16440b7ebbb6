"""CUDA-graph decode: the model's forward for decode-only steps captured once
per batch size and replayed, so that a decode step costs the host one graph
launch instead of a few hundred kernel launches (as vLLM, SGLang and
nano-vllm do). Sampling stays outside the graph.

Data flow: ModelExecutor.execute hands a decode-only step of B requests here;
the runner pads it to the smallest captured size P >= B (`padded_size`),
writes the step's inputs into the static buffers the graphs read (token ids,
positions, slot mapping, context lengths, block tables) and replays the graph
of P; the hidden states of the first B rows go on to sampling. Steps with
prefill tokens, or more decodes than the largest size, run eagerly.

Padding rows decode token 0 at position 0 in the scratch block: a KV block
past the BlockManager's, which no request owns. They write their K/V there
and attend over its first slot only, so they touch no request's KV and
their hidden states are never sampled.

Without a GPU (the tests) the runner runs the same padded forward eagerly
over the same buffers instead of replaying a graph."""
from __future__ import annotations

import bisect
from collections.abc import Sequence

import numpy as np
import torch

from testbed.kernels.attention import AttentionBackend, DecodeMetadata


def padded_size(num_seqs: int, sizes: Sequence[int]) -> int | None:
    """The smallest of the (sorted) captured sizes that holds num_seqs decodes;
    None when it is larger than all of them (the step then runs eagerly)."""
    i = bisect.bisect_left(sizes, num_seqs)
    return sizes[i] if i < len(sizes) else None


class DecodeGraphRunner:
    def __init__(self, model: torch.nn.Module, kv_cache: torch.Tensor, backend: AttentionBackend,
                 sizes: Sequence[int], block_size: int, scratch_block: int):
        """kv_cache: [num_layers, 2, num_blocks, block_size, Hkv, D] whose block
        `scratch_block` no request owns; a block table holds up to all the others."""
        self.model, self.kv_cache, self.backend = model, kv_cache, backend
        self.sizes = sorted(set(sizes))
        self.block_size, self.scratch_block = block_size, scratch_block
        device, n = kv_cache.device, self.sizes[-1]
        max_blocks = scratch_block          # the BlockManager's blocks: a sequence may hold them all
        with torch.inference_mode():
            self.token_ids = torch.zeros(n, dtype=torch.long, device=device)
            self.positions = torch.zeros(n, dtype=torch.long, device=device)
            self.slot_mapping = torch.full((n,), scratch_block * block_size, dtype=torch.long, device=device)
            self.seq_lens = torch.ones(n, dtype=torch.int32, device=device)
            self.block_tables = torch.full((n, max_blocks), scratch_block, dtype=torch.int32, device=device)
            self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
            self.first_query = torch.zeros(n, dtype=torch.int32, device=device)
            self.hidden = torch.zeros(n, model.cfg.hidden_size, dtype=kv_cache.dtype, device=device)
            self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
            if device.type == "cuda":
                self._capture()

    def metadata(self, size: int) -> DecodeMetadata:
        """The attention metadata of a padded step of `size` rows: views of the static buffers."""
        return DecodeMetadata(self.seq_lens[:size], self.block_tables[:size], self.slot_mapping[:size],
                              self.query_start_loc[:size + 1], self.first_query[:size], self.block_size)

    def _forward(self, size: int) -> None:
        self.hidden[:size] = self.model(self.token_ids[:size], self.positions[:size], self.kv_cache,
                                        self.metadata(size), self.backend)

    def _capture(self) -> None:
        """Largest size first, all graphs in one memory pool (the smaller ones
        reuse the largest one's activations)."""
        pool = None
        for size in reversed(self.sizes):
            self._forward(size)                      # warm-up off the graph: compiles the kernels
            torch.cuda.synchronize(self.kv_cache.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self._forward(size)
            pool = graph.pool()
            self.graphs[size] = graph
        torch.cuda.synchronize(self.kv_cache.device)

    def run(self, token_ids: list[int], positions: list[int], slots: list[int], seq_lens: list[int],
            block_tables: list[list[int]]) -> torch.Tensor | None:
        """Hidden states [B, hidden] of a decode-only step of B sequences (one
        token each), or None when B exceeds every captured size. The view is
        valid until the next run."""
        num_seqs = len(token_ids)
        size = padded_size(num_seqs, self.sizes)
        if size is None:
            return None
        pad = size - num_seqs
        width = max(len(t) for t in block_tables)
        tables = np.full((size, width), self.scratch_block, dtype=np.int32)
        for b, t in enumerate(block_tables):
            tables[b, :len(t)] = t
        scratch_slot = self.scratch_block * self.block_size
        longs = torch.tensor([token_ids + [0] * pad, positions + [0] * pad, slots + [scratch_slot] * pad])
        self.token_ids[:size].copy_(longs[0])
        self.positions[:size].copy_(longs[1])
        self.slot_mapping[:size].copy_(longs[2])
        self.seq_lens[:size].copy_(torch.tensor(seq_lens + [1] * pad, dtype=torch.int32))
        # columns past a row's own blocks keep older ids: never read past seq_len
        self.block_tables[:size, :width].copy_(torch.from_numpy(tables))
        if self.graphs:
            self.graphs[size].replay()
        else:
            self._forward(size)
        return self.hidden[:num_seqs]
