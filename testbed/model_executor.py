"""The real executor: one forward pass of the model for a mixed batch of
decodes and prefill chunks over the paged KV cache, then sampling.

KV cache layout: [num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim];
a token at position p of a request lives in slot block_table[p // block_size] *
block_size + p % block_size (the slot mapping)."""
from __future__ import annotations

import time
from typing import Callable

import torch

from testbed.batch import Batch, StepResult
from testbed.executor import Executor, LayerHook
from testbed.kernels.attention import AttentionMetadata, get_attention_backend
from testbed.model.config import ModelConfig
from testbed.model.loader import TORCH_DTYPES, load_model
from testbed.sampling import sample


class ModelExecutor(Executor):
    def __init__(self, model_cfg: ModelConfig, num_blocks: int, block_size: int,
                 block_table: Callable[[str], list[int]], attention_backend: str = "torch",
                 device: str = "cpu"):
        self.backend = get_attention_backend(attention_backend)
        self.model, self.model_cfg = load_model(model_cfg, device)
        self.device = torch.device(device)
        self.block_size = block_size
        self.block_table = block_table
        cfg = self.model_cfg
        self.kv_cache = torch.zeros(cfg.num_layers, 2, num_blocks, block_size, cfg.num_kv_heads,
                                    cfg.resolved_head_dim, dtype=TORCH_DTYPES[cfg.dtype], device=self.device)
        self.kv_bytes_per_token = cfg.kv_bytes_per_token
        self.num_layers = cfg.num_layers

    def _prepare(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int]]:
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
        dev = self.device
        meta = AttentionMetadata(query_start_loc, seq_lens, tables,
                                 torch.tensor(slots, dtype=torch.long, device=dev), bs)
        return (torch.tensor(token_ids, dtype=torch.long, device=dev),
                torch.tensor(positions, dtype=torch.long, device=dev), meta, sample_rows)

    @torch.inference_mode()
    def execute(self, batch: Batch, on_layer_done: LayerHook | None = None) -> StepResult:
        t0 = time.perf_counter()
        input_ids, positions, meta, sample_rows = self._prepare(batch)
        hidden = self.model(input_ids, positions, self.kv_cache, meta, self.backend, on_layer_done)
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
