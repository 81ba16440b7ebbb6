"""mode=kvstore, the fault "a block evicted between lookup and fetch:
that part is recomputed", caused for real at the worker level. The prefill
workers reach the real store process through a ZMQ relay (real sockets, a
thread of this test); the first time a lookup (`contains`) finds blocks, the
relay, before handing that answer back, fills the store with other blocks
from a client of its own, so the store's LRU evicts what the lookup found.
The worker's read then gets fewer blocks than its lookup promised: it
computes the rest, generates the colocated tokens, and frees every block."""
from __future__ import annotations

import os

import pytest

from store_relay import RelayedRuntime, StoreRelay
from test_kvstore import colocated, config  # noqa: F401  (colocated: the fixture)
from testbed.kv_transfer.store_client import StoreClient
from testbed.runtime.build import apply_sampling
from testbed.runtime.messages import PrefixFetched
from testbed.workloads.build import build_workload

CAPACITY_BYTES = 4 * 2**20


class EvictingRelay(StoreRelay):
    """Evicts the store's blocks once, between the first lookup that finds any and its answer."""

    def __init__(self, store_addr: str, host: str):
        super().__init__(store_addr, host)
        self.block_nbytes = 0                       # from the first put that passes
        self.evicted_after: tuple[bytes, int] | None = None    # (client, the lookup's request id)
        self.evictions_caused = 0
        self._lookups: set[tuple[bytes, int]] = set()

    def on_request(self, client: bytes, header: dict) -> None:
        if header.get("op") == "contains":
            self._lookups.add((client, header["id"]))
        elif header.get("op") == "put" and header.get("blocks") and not self.block_nbytes:
            self.block_nbytes = int(header["blocks"][0][2])

    def on_reply(self, client: bytes, reply: dict) -> None:
        if (client, reply.get("id")) in self._lookups:
            self._lookups.discard((client, reply["id"]))
            if reply.get("n", 0) > 0 and self.evicted_after is None:
                self.evicted_after = (client, reply["id"])
                self._fill_the_store()

    def _fill_the_store(self) -> None:
        """More new blocks than the store holds: every unpinned block it had is evicted."""
        assert self.block_nbytes, "a lookup found blocks before any put passed"
        client = StoreClient(self.store_addr, 10, 0, "evictor")
        try:
            n = CAPACITY_BYTES // self.block_nbytes + 1
            before = client.stats()["evictions"]
            blocks = [os.urandom(self.block_nbytes) for _ in range(n)]
            keys = [(1 << 62) + i for i in range(n)]        # no prompt's chained hash
            for i in range(0, n, 16):
                client.put(keys[i:i + 16], blocks[i:i + 16])
            self.evictions_caused = client.stats()["evictions"] - before
        finally:
            client.close()


@pytest.mark.slow          # ~55 s here with its colocated reference (2 shared cores, loaded)
def test_a_block_evicted_between_lookup_and_fetch_is_recomputed(colocated):  # noqa: F811
    # two prefill workers, round robin: a conversation's next turn lands on the other one,
    # whose own cache lacks the prefix the store holds
    cfg = config(prefill_workers=2, decode_workers=1, kvstore={"capacity_bytes": CAPACITY_BYTES})
    fetched: list[PrefixFetched] = []
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    rt = RelayedRuntime(cfg, EvictingRelay,
                        on_event=lambda _, ev: fetched.append(ev) if type(ev) is PrefixFetched else None)
    result = rt.run(requests)
    assert rt.relay.error is None, rt.relay.error
    assert rt.relay.evicted_after is not None, "no lookup found a block in the store: nothing was evicted"
    assert rt.relay.evictions_caused > 0

    assert {r.request_id: (r.status, r.error) for r in result.records} == {rid: ("finished", None) for rid in colocated}
    assert {r.request_id: r.output_token_ids for r in result.records} == colocated
    assert all(s["all_free"] for s in result.worker_stats.values()) and len(result.worker_stats) == 3
    # the lookup found blocks that the read no longer got: exactly one such request, the one the relay hit
    short = [ev for ev in fetched if ev.found_tokens > ev.store_tokens]
    assert len(short) == 1, [(ev.id, ev.found_tokens, ev.store_tokens) for ev in fetched]
    hit = short[0]
    record = next(r for r in result.records if r.request_id == hit.id)
    assert record.num_external_cached_tokens == hit.store_tokens < hit.found_tokens
    # ... and computed it: every prompt token not reused was prefilled, the evicted part included
    computed = sum(it.num_prefill_tokens for it in result.iterations)
    assert computed == sum(r.prompt_len - r.num_cached_tokens for r in result.records)
