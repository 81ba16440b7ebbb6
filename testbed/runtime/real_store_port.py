"""StorePort over the real KV store process (kv_transfer/store_service.py):
blocks move between the worker's paged KV cache and the store as one frame
per block, `[num_layers, 2, block_size, num_kv_heads, head_dim]` of the
cache's dtype, checksummed by the sender and verified by the receiver."""
from __future__ import annotations

import time

import torch

from testbed.kv_transfer.store_client import StoreClient, StoreDown
from testbed.runtime.store_port import Fetched, StorePort


class RealStorePort(StorePort):
    def __init__(self, client: StoreClient, cache: torch.Tensor):
        self.client = client
        self.cache = cache                                    # [layers, 2, blocks, block_size, kv_heads, head_dim]
        self.block_shape = (cache.shape[0], 2, *cache.shape[3:])

    def fetch(self, request_id, keys, on_done) -> None:
        start = time.monotonic()
        found, blocks, error = 0, [], None
        try:
            found = self.client.contains(keys)
            blocks = self.client.get(keys[:found]) if found else []
            if len(blocks) < found and self.client.num_corrupt:
                error = "a block failed its checksum or was evicted after the lookup"
        except StoreDown as e:
            error = str(e)
        on_done(Fetched(request_id, found, blocks, time.monotonic() - start, error))

    def write(self, fetched, block_ids) -> None:
        for data, block_id in zip(fetched.blocks, block_ids):
            block = torch.frombuffer(data, dtype=self.cache.dtype).view(self.block_shape)
            self.cache[:, :, block_id].copy_(block)

    def publish(self, keys, block_ids) -> int:
        """Sent without waiting for the store's answer: the count is of blocks sent."""
        if not keys:
            return 0
        # one gather for all blocks: [blocks, layers, 2, block_size, kv_heads, head_dim], each a frame
        index = torch.tensor(block_ids, device=self.cache.device)
        data = self.cache.index_select(2, index).movedim(2, 0).contiguous().cpu()
        frames = [data[i].reshape(-1).view(torch.uint8).numpy() for i in range(len(block_ids))]
        return len(keys) if self.client.put_nowait(keys, frames) else 0

    def flush(self) -> None:
        try:
            self.client.flush()
        except StoreDown:
            pass                      # a store that is gone keeps nothing more: nothing to wait for

    def close(self) -> None:
        self.client.close()
