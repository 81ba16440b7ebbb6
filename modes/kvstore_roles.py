"""The prefill role of `mode=kvstore` (modes/kvstore.py has the hand-off);
its decode role is disagg's DecodeWorker, unchanged.

`KVStorePrefillWorker` is disagg's prefill worker with a shared KV store
behind its own prefix cache. On `Prefill`:
  1. its own cache first: `match_prefix` takes the longest run of cached
     full blocks (the request now holds them);
  2. then the store: the next blocks' chained keys are looked up and the
     leading run found is read (StorePort.fetch) into newly allocated blocks,
     which are registered in its prefix cache like computed ones;
  3. the request joins the scheduler with `num_computed_tokens` at the end of
     that prefix, so only the suffix is computed, chunked or whole as the
     scheduler says.
Once the first token is sampled the KV goes to the decode worker exactly as
in disagg (pushed into its reserved blocks), and then the prompt's full
blocks that were computed here are published to the store.

Push, not pull from the store: the decode side's blocks are reserved before
the prefill starts, so the push cannot fail for room, it is one transfer on
the critical path instead of two (prefill -> store -> decode), and the store
stays off the path of correctness: a store that is gone, full or corrupted
costs reuse, never a request. Whatever the store does, fewer blocks come back
and the rest is recomputed."""
from __future__ import annotations

from testbed.block_keys import prefix_block_keys
from testbed.engine import StepOutput
from testbed.modes.disagg_roles import PrefillWorker
from testbed.request import Request
from testbed.runtime.messages import Prefill, PrefixFetched
from testbed.runtime.store_port import Fetched


class KVStorePrefillWorker(PrefillWorker):
    role = "kvstore_prefill"
    uses_store = True

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fetching: dict[str, tuple[Request, int]] = {}     # id -> (request, its local cached blocks)
        self.publish_from: dict[str, tuple[list[int], int]] = {}  # id -> (its full blocks' keys, first computed here)
        self._handlers[Prefill] = self._prefill

    def _prefill(self, msg: Prefill) -> None:
        req = msg.request.to_request()
        rid = req.request_id
        self.handoff[rid] = (msg.peer, msg.dst_blocks)
        bm = self.engine.bm
        bs = bm.block_size
        local = bm.match_prefix(req) // bs
        keys = prefix_block_keys(req, bs, req.prompt_len // bs)
        self.publish_from[rid] = (keys, local)
        # never the block of the prompt's last token: a step must compute one token to sample from
        lookup = keys[local:(req.prompt_len - 1) // bs]
        self.fetching[rid] = (req, local)
        if self.store is None or not lookup:
            self._fetched(Fetched(rid, 0))
        else:
            self.store.fetch(rid, lookup, self._fetched)

    def _fetched(self, f: Fetched) -> None:
        entry = self.fetching.pop(f.request_id, None)
        if entry is None:
            return                                # ended while its blocks were on the way
        req, local = entry
        bm = self.engine.bm
        bs = bm.block_size
        n = f.num_blocks
        if n and not bm.allocate(req, (local + n) * bs):
            n = 0                                 # no room for them now: computed instead
        if n:
            self.store.write(f, bm.block_table(req.request_id)[local:local + n])
        req.num_computed_tokens = (local + n) * bs
        if n:
            bm.commit(req)                        # findable in this worker's own cache from now on
        keys, _ = self.publish_from[req.request_id]
        self.publish_from[req.request_id] = (keys, local + n)
        self.emit(PrefixFetched(req.request_id, self.worker_id, local * bs, n * bs, f.num_found * bs, f.fetch_s))
        self.engine.add_request(req)

    def _after_finished(self, out: StepOutput) -> None:
        super()._after_finished(out)              # the hand-off first: it is on the first token's path
        bm = self.engine.bm
        for req in out.prefill_completed:
            keys, start = self.publish_from.pop(req.request_id, ([], 0))
            table = bm.block_table(req.request_id)
            if self.store is not None and table and start < len(keys):
                self.store.publish(keys[start:], table[start:len(keys)])

    def _holds(self, request_id: str) -> bool:
        return request_id in self.fetching or super()._holds(request_id)

    def _release(self, request_id: str) -> None:
        if self.fetching.pop(request_id, None) is not None and self.store is not None:
            self.store.cancel(request_id)
        self.publish_from.pop(request_id, None)
        super()._release(request_id)

    def _forget(self, request_id: str) -> None:
        self.publish_from.pop(request_id, None)
        super()._forget(request_id)
