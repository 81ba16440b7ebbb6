"""The real executor: one forward pass of the model for a mixed batch of
decodes and prefill chunks over the paged KV cache, then sampling.

KV cache layout: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
a token at position p of a request lives in slot block_table[p // block_size] *
block_size + p % block_size (the slot mapping).

With `cuda_graph_sizes` (testbed/model/cuda_graphs.py), decode-only steps
replay a captured CUDA graph; the cache then holds one more block, the
graphs' scratch block, which the BlockManager never hands out."""
from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Callable

import torch

from testbed.batch import Batch, StepResult
from testbed.executor import Executor, LayerHook
from testbed.kernels.attention import AttentionMetadata, get_attention_backend
from testbed.model.config import ModelConfig
from testbed.model.cuda_graphs import DecodeGraphRunner
from testbed.model.loader import TORCH_DTYPES, load_model
from testbed.sampling import sample


class ModelExecutor(Executor):
    def __init__(self, model_cfg: ModelConfig, num_blocks: int, block_size: int,
                 block_table: Callable[[str], list[int]], attention_backend: str = "torch",
                 device: str = "cpu", cuda_graph_sizes: Sequence[int] = ()):
        """cuda_graph_sizes: decode batch sizes to capture ([]: every step eager;
        on the CPU the same padded steps run eagerly, which only tests want)."""
        self.backend = get_attention_backend(attention_backend)
        self.model, self.model_cfg = load_model(model_cfg, device)
        self.device = torch.device(device)
        self.block_size = block_size
        self.block_table = block_table
        cfg = self.model_cfg
        scratch = 1 if cuda_graph_sizes else 0
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks + scratch, block_size, cfg.num_kv_heads,
                                    cfg.resolved_head_dim, dtype=TORCH_DTYPES[cfg.dtype], device=self.device)
        self.kv_bytes_per_token = cfg.kv_bytes_per_token
        self.num_layers = cfg.num_layers
        self.graphs = (DecodeGraphRunner(self.model, self.kv_cache, self.backend, cuda_graph_sizes, block_size,
                                         scratch_block=num_blocks) if cuda_graph_sizes else None)

    def _prepare(self, batch: Batch) -> tuple[list[int], list[int], list[int], list[int], list[int],
                                              list[list[int]], list[int]]:
        """Host lists: token ids, positions, slots, query_start_loc, seq_lens, block tables, sampled rows."""
        bs = self.block_size
        token_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for sl in batch.slices:
            req, start, end = sl.request, sl.start, sl.end
            table = self.block_table(req.request_id)
            if end - start == 1:
                # not always the last token: a preempted request recomputes its
                # earlier outputs, 1 token at a time when the budget leaves 1
                token_ids.append(req.prompt_token_ids[start] if start < req.prompt_len
                                 else req.output_token_ids[start - req.prompt_len])
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                token_ids.extend(req.token_ids(start, end))
                positions.extend(range(start, end))
                slots.extend(table[p // bs] * bs + p % bs for p in range(start, end))
            query_start_loc.append(len(token_ids))
            seq_lens.append(end)
            tables.append(table)
            if sl.samples:
                sample_rows.append(len(token_ids) - 1)
        return token_ids, positions, slots, query_start_loc, seq_lens, tables, sample_rows

    def _forward(self, batch: Batch, on_layer_done: LayerHook | None) -> tuple[torch.Tensor, list[int]]:
        """The final hidden states [num_tokens, hidden] and the rows to sample."""
        token_ids, positions, slots, query_start_loc, seq_lens, tables, sample_rows = self._prepare(batch)
        # a layer hook runs host code between layers, which a graph cannot
        if self.graphs is not None and on_layer_done is None and seq_lens and len(token_ids) == len(seq_lens):
            hidden = self.graphs.run(token_ids, positions, slots, seq_lens, tables)
            if hidden is not None:
                return hidden, sample_rows
        dev = self.device
        meta = AttentionMetadata(query_start_loc, seq_lens, tables,
                                 torch.tensor(slots, dtype=torch.long, device=dev), self.block_size)
        hidden = self.model(torch.tensor(token_ids, dtype=torch.long, device=dev),
                            torch.tensor(positions, dtype=torch.long, device=dev), self.kv_cache, meta,
                            self.backend, on_layer_done)
        return hidden, sample_rows

    @torch.inference_mode()
    def execute(self, batch: Batch, on_layer_done: LayerHook | None = None) -> StepResult:
        t0 = time.perf_counter()
        hidden, sample_rows = self._forward(batch, on_layer_done)
        sampling = [sl for sl in batch.slices if sl.samples]
        sampled: dict[str, int] = {}
        if sampling:
            logits = self.model.compute_logits(hidden[sample_rows])          # [num_sampled, vocab]
            tokens = sample(logits, [sl.request.sampling for sl in sampling],
                            [sl.request.request_id for sl in sampling],
                            [sl.request.num_output_tokens for sl in sampling])
            sampled = {sl.request.request_id: t for sl, t in zip(sampling, tokens)}
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return StepResult(sampled=sampled, duration_s=time.perf_counter() - t0,
                          kv_bytes_read=self.kv_bytes_read(batch))
