"""The KV store's bookkeeping (kv_transfer/store_index.py) and its service
over real sockets (store_service.py, store_client.py): exact LRU order, pins,
a full store refusing puts, checksums both ways, a block evicted between a
lookup and its read, malformed requests answered, never fatal."""
from __future__ import annotations

import threading
import time

import msgpack
import pytest
import zmq

from testbed.kv_transfer.store_client import StoreClient, StoreDown
from testbed.kv_transfer.store_config import KVStoreConfig
from testbed.kv_transfer.store_index import StoreIndex
from testbed.kv_transfer.store_service import StoreServer


def test_lru_evicts_the_least_recently_used_unpinned_block():
    idx = StoreIndex(capacity_bytes=300)
    for k in (1, 2, 3):
        assert idx.put(k, 100)
    assert idx.lookup([1, 2, 9, 3]) == 2
    assert idx.get([1]) == [(1, 100, None)]            # 1 is now the most recent
    assert idx.put(4, 100)                             # evicts 2, the least recent
    assert idx.keys() == [3, 1, 4]
    idx.pin([3])
    assert idx.put(5, 100)                             # 3 is pinned: 1 goes
    assert idx.keys() == [3, 4, 5]
    idx.pin([4, 5])
    assert not idx.put(6, 100)                         # everything pinned: refused, nothing evicted
    assert idx.keys() == [3, 4, 5]
    assert not idx.put(7, 301)                         # larger than the store
    idx.unpin([3, 4, 5])
    assert idx.put(6, 200) and idx.keys() == [5, 6]
    c = idx.counters
    assert (c.hits, c.misses, c.evictions, c.puts_rejected, c.bytes_to_store) == (2, 2, 4, 2, 700)
    assert idx.used_bytes == 300 and idx.num_pinned() == 0


@pytest.mark.parametrize("capacity,disk,pinned", [(None, 0, False), (1000, 0, False), (1000, 0, True),
                                                   (1000, 300, False), (50, 0, False)])
def test_put_many_is_put_of_each_key_in_turn(capacity, disk, pinned):
    """The simulator's batch put (its inlined path, and the fallback to put where pins,
    a disk tier, no bound or an oversized block make it differ) leaves the index, its
    LRU order and every counter as put() of each key would, and says how many were kept."""
    import random
    rng = random.Random(7)
    one, many = StoreIndex(capacity, disk), StoreIndex(capacity, disk)
    for step in range(300):
        keys = [rng.randrange(40) for _ in range(rng.randrange(1, 8))]
        if pinned and step % 50 == 0:
            pins = rng.sample(range(40), 5)
            for idx in (one, many):
                idx.unpin(list(idx._pins))
                idx.pin(pins)
        if step % 7 == 0:
            for idx in (one, many):
                idx.get(keys[:2])
        kept = sum(one.put(k, 100) for k in keys)
        assert many.put_many(keys, 100) == kept
        assert (many.keys(), list(many._disk), many.used_bytes, many.disk_used_bytes) == \
            (one.keys(), list(one._disk), one.used_bytes, one.disk_used_bytes)
        assert many.counters == one.counters
    c = one.counters                                   # not vacuous: each path was taken
    if capacity == 50:
        assert c.puts_rejected == c.puts > 0           # every block is larger than the store
    else:
        assert c.blocks_refreshed > 0 and (capacity is None or c.evictions > 0)
        assert not disk or c.demotions > 0


def test_put_of_a_stored_block_only_refreshes_it():
    idx = StoreIndex(capacity_bytes=None)
    assert idx.put(1, 10) and idx.put(2, 10) and idx.put(1, 10)
    assert idx.keys() == [2, 1] and idx.used_bytes == 20 and idx.counters.blocks_refreshed == 1


@pytest.fixture
def server():
    """A StoreServer serving on a real socket from a thread of this process."""
    ctx = zmq.Context()
    servers = []

    def start(delay_s: float = 0.0, **cfg):
        srv = StoreServer(KVStoreConfig(**cfg), "127.0.0.1", ctx)
        stop = threading.Event()

        def loop():
            time.sleep(delay_s)             # a store busy elsewhere: requests queue meanwhile
            while not stop.is_set():
                if srv.sock.poll(10):
                    srv.serve()
                srv.serve()
        t = threading.Thread(target=loop, daemon=True)
        t.start()
        servers.append((srv, stop, t))
        return srv
    yield start
    for srv, stop, t in servers:
        stop.set()
        t.join(5)
        srv.close()
    ctx.term()


def blocks(n: int, size: int = 4096, base: int = 0) -> list[bytes]:
    return [bytes([(base + i) % 256]) * size for i in range(n)]


def test_put_get_contains_round_trip(server):
    srv = server(capacity_bytes=None)
    c = StoreClient(srv.address, timeout_s=5, retry_s=0)
    try:
        assert c.put([11, 12, 13], blocks(3)) == (3, 0)
        assert c.contains([11, 12, 99, 13]) == 2
        got = c.get([11, 12, 13, 14])
        assert [bytes(b) for b in got] == blocks(3)
        s = c.stats()
        assert (s["hits"], s["misses"], s["blocks_served"], s["get_misses"]) == (2, 2, 3, 1)
        assert (s["bytes_to_store"], s["bytes_from_store"]) == (3 * 4096, 3 * 4096)
        # the get's pins go once zmq has let go of its frames (pyzmq tells so from a thread of its own,
        # some time after the bytes left): each serve looks, so they go within a few more requests
        for _ in range(1000):
            if srv.index.num_pinned() == 0:
                break
            c.contains([11])
            time.sleep(0.005)
        assert srv.index.num_pinned() == 0
    finally:
        c.close()


def test_flush_returns_once_the_store_has_taken_every_put_sent_before(server):
    """A stopping worker flushes before it reports: its last publishes (sent
    without waiting) are counted by the store, not dropped with its socket."""
    srv = server(delay_s=0.3, capacity_bytes=None)
    c = StoreClient(srv.address, timeout_s=5, retry_s=0)
    try:
        for i in range(10):
            assert c.put_nowait([100 + 5 * i + j for j in range(5)], blocks(5, base=i))
        assert srv.index.counters.puts == 0           # the store has not served yet
        c.flush()
        assert (srv.index.counters.puts, srv.index.counters.blocks_stored) == (50, 50)
    finally:
        c.close()


def test_block_evicted_between_lookup_and_read_is_not_served(server):
    srv = server(capacity_bytes=4 * 4096)
    a, b = StoreClient(srv.address, 5, 0, "a"), StoreClient(srv.address, 5, 0, "b")
    try:
        a.put([1, 2, 3, 4], blocks(4))
        assert a.contains([1, 2, 3, 4]) == 4
        b.get([1, 2])                           # 1, 2 refreshed; 3 and 4 are now the oldest
        b.put([5, 6], blocks(2, base=50))       # evicts 3 and 4 after a's lookup
        got = a.get([1, 2, 3, 4])
        assert [bytes(x) for x in got] == blocks(2)     # the prefix up to the hole; the rest is recomputed
    finally:
        a.close()
        b.close()


def test_corrupted_blocks_are_never_used(server):
    srv = server(capacity_bytes=None, fault_corrupt_nth_get=2)
    c = StoreClient(srv.address, 5, 0)
    try:
        c.put([1, 2, 3], blocks(3))
        assert [bytes(x) for x in c.get([1, 2, 3])] == blocks(1)    # block 2 corrupted on the way: 2 and 3 dropped
        assert c.num_corrupt == 1
        # a put whose bytes do not match its checksum is refused by the store
        sock = c._socket()
        sock.send_multipart([msgpack.packb({"op": "put", "id": 999, "blocks": [[7, 1234, 4096]]}), blocks(1)[0]])
        assert msgpack.unpackb(sock.recv_multipart()[0])["corrupt"] == 1
        assert 7 not in srv.index and srv.index.counters.puts_corrupt == 1
    finally:
        c.close()


def test_a_full_store_refuses_puts_without_error(server):
    srv = server(capacity_bytes=100)            # smaller than one block
    c = StoreClient(srv.address, 5, 0)
    try:
        assert c.put([1, 2], blocks(2)) == (0, 2)
        assert c.contains([1, 2]) == 0 and len(srv.index) == 0
    finally:
        c.close()


@pytest.mark.parametrize("frames", [
    [b"\xc1garbage"],
    [msgpack.packb([1, 2])],
    [msgpack.packb({"op": "get", "id": 1, "keys": ["x"]})],
    [msgpack.packb({"op": "nope", "id": 1})],
    [msgpack.packb({"op": "put", "id": 1, "blocks": [[1, 2, 3]]})],          # declares a frame it lacks
    [msgpack.packb({"op": "contains", "id": 1, "keys": [-1]})],
])
def test_malformed_requests_get_an_error_and_the_store_serves_on(server, frames):
    srv = server(capacity_bytes=None)
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.connect(srv.address)
    c = StoreClient(srv.address, 5, 0)
    try:
        raw.send_multipart(frames)
        assert raw.poll(5000)
        assert msgpack.unpackb(raw.recv_multipart()[0])["ok"] is False
        assert c.put([1], blocks(1)) == (1, 0) and c.contains([1]) == 1
        assert srv.num_bad_requests == 1
    finally:
        raw.close(0)
        ctx.term()
        c.close()


def test_a_store_that_does_not_answer_costs_one_timeout():
    ctx = zmq.Context()
    silent = ctx.socket(zmq.ROUTER)          # bound, never answers
    port = silent.bind_to_random_port("tcp://127.0.0.1")
    c = StoreClient(f"tcp://127.0.0.1:{port}", timeout_s=0.2, retry_s=30)
    try:
        with pytest.raises(StoreDown, match="no reply"):
            c.contains([1])
        with pytest.raises(StoreDown, match="timed out less than"):
            c.contains([1])                  # at once, without waiting again
        assert c.num_timeouts == 1
    finally:
        c.close()
        silent.close(0)
        ctx.term()



def test_disk_tier_takes_what_dram_evicts_and_gives_it_back(tmp_path):
    from testbed.kv_transfer.store_service import DiskTier
    from testbed.kv_transfer.store_wire import block_checksum
    disk = DiskTier(str(tmp_path / "tier"))
    idx = StoreIndex(capacity_bytes=2 * 4, disk_capacity_bytes=2 * 4, disk=disk)
    value = {k: (block_checksum(bytes([k]) * 4), bytes([k]) * 4) for k in range(1, 6)}
    for k in (1, 2, 3, 4):
        idx.put(k, 4, value[k])
    assert idx.keys() == [3, 4] and idx.num_disk_blocks == 2 and idx.lookup([1, 2, 3, 4]) == 4
    assert sorted(p.name for p in (tmp_path / "tier").iterdir()) == [f"{1:016x}.kv", f"{2:016x}.kv"]
    got = idx.get([1])                                  # from disk, back into DRAM (3 goes down)
    assert got == [(1, 4, value[1])] and idx.keys() == [4, 1] and 3 in idx
    idx.put(5, 4, value[5])                     # 4 goes down, 2 (the disk's oldest) leaves the store
    assert 2 not in idx and idx.counters.evictions == 1 and idx.counters.disk_hits == 1
    (tmp_path / "tier" / f"{3:016x}.kv").write_bytes(b"\0" * 12)    # a damaged file
    assert idx.get([3]) == [] and 3 not in idx          # never served: recomputed by whoever asked


def test_sim_disk_tier_counts_as_the_real_one():
    idx = StoreIndex(capacity_bytes=8, disk_capacity_bytes=8)        # sizes only, as in the simulator
    for k in (1, 2, 3, 4):
        idx.put(k, 4)
    assert idx.num_on_disk([1, 2, 3]) == 2 and idx.get([1, 2, 3]) == [(1, 4, None), (2, 4, None), (3, 4, None)]
    assert idx.counters.disk_hits == 3       # 1, 2 promoted push 3, 4 down: 3 is then read from disk too


def test_put_of_a_block_on_disk_refreshes_it_there_without_a_second_copy(tmp_path):
    from testbed.kv_transfer.store_service import DiskTier
    from testbed.kv_transfer.store_wire import block_checksum
    value = {k: (block_checksum(bytes([k]) * 4), bytes([k]) * 4) for k in range(1, 5)}
    idx = StoreIndex(capacity_bytes=4, disk_capacity_bytes=3 * 4, disk=DiskTier(str(tmp_path / "tier")))
    for k in (1, 2, 3):
        idx.put(k, 4, value[k])                         # 1, 2 on disk, 3 in DRAM
    assert idx.put(1, 4, value[1])                      # a worker recomputed 1 and published it again
    assert idx.keys() == [3] and idx.num_disk_blocks == 2 and idx.counters.blocks_refreshed == 1
    idx.put(4, 4, value[4])                             # 3 goes down; 2 is now the disk's oldest, not 1
    assert idx.disk_used_bytes == 3 * 4 and idx.counters.evictions == 0
    assert idx.get([1, 2, 3]) == [(k, 4, value[k]) for k in (1, 2, 3)]
    assert idx.disk_used_bytes == len(list((tmp_path / "tier").iterdir())) * 4


def test_damaged_disk_files_are_dropped_counted_and_never_served(tmp_path, caplog):
    from testbed.kv_transfer.store_service import DiskTier
    from testbed.kv_transfer.store_wire import block_checksum
    tier = tmp_path / "tier"
    value = {k: (block_checksum(bytes([k]) * 64), bytes([k]) * 64) for k in range(1, 9)}
    idx = StoreIndex(capacity_bytes=64, disk_capacity_bytes=100 * 64, disk=DiskTier(str(tier)))
    for k in range(1, 8):
        idx.put(k, 64, value[k])                        # 1..6 on disk, 7 in DRAM
    file = {k: tier / f"{k:016x}.kv" for k in range(1, 9)}
    file[1].write_bytes(file[1].read_bytes()[:3])       # shorter than its checksum
    raw = bytearray(file[2].read_bytes())
    raw[40] ^= 0xFF                                     # a flipped byte inside the block
    file[2].write_bytes(raw)
    file[3].write_bytes(b"\xa5" * (8 + 64))             # garbage of the right length
    file[4].unlink()
    file[5].unlink()
    file[5].mkdir()                                     # a directory in its place: unreadable, even for root
    with caplog.at_level("WARNING"):
        for k in (1, 2, 3, 4, 5):
            assert idx.get([k, 6]) == [] and k not in idx     # never served, gone from the index
    assert [str(file[k]) in caplog.text for k in (1, 2, 3, 4, 5)] == [True] * 5
    c = idx.counters
    assert (c.disk_corrupt, c.disk_read_errors, c.disk_hits, c.evictions) == (3, 2, 0, 5)
    assert idx.get([6]) == [(6, 64, value[6])]          # the intact one still is
    assert idx.num_disk_blocks == 1 and idx.disk_used_bytes == 64    # 7, pushed down by 6
    # the directory stays (not the store's to delete); a block evicted onto its name is not kept
    assert idx.put(5, 64, value[5])                     # recomputed and published again: 6 goes down
    assert idx.put(8, 64, value[8])                     # 5 goes down, onto the directory: it leaves the store
    assert file[5].is_dir() and 5 not in idx and c.disk_write_errors == 1 and c.evictions == 6
    assert idx.num_disk_blocks == 2 and idx.disk_used_bytes == 2 * 64 and idx.get([6, 7]) != []
