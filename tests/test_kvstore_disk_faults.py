"""mode=kvstore, the fault "a corrupted block: never used; recomputed",
caused for real in the store's disk tier. A real run (tiny model, fp32, one
prefill worker over zmq, its own prefix cache off so that every reuse comes
from the store) has a DRAM tier of 8 blocks and a disk tier behind it. The
prefill worker reaches the store through a ZMQ relay (a thread of this test);
before the relay hands the store a `get`, it damages the file of the first
block of that get which is on disk, one kind per get: truncated, a flipped
byte, garbage of the right length, deleted, a directory in its place (chmod
000 does not stop root). So each damaged file is read right after it was
damaged. Each time the store drops the block (counted, one log line), the
worker gets the prefix up to it, computes the rest, and the run generates the
colocated tokens with every block free and the store's stats delivered."""
from __future__ import annotations

import multiprocessing
import os
from pathlib import Path

import pytest

from store_relay import RelayedRuntime, StoreRelay
from test_kvstore import colocated, config  # noqa: F401  (colocated: the fixture)
from testbed.block_keys import prefix_block_keys
from testbed.runtime.build import apply_sampling
from testbed.runtime.messages import PrefixFetched
from testbed.workloads.build import build_workload

BLOCK_BYTES = 2048 * 16          # tiny: 2 KiB of KV per token, 16-token blocks


def truncate(f: Path) -> None:
    os.truncate(f, f.stat().st_size // 2)


def flip(f: Path) -> None:
    raw = bytearray(f.read_bytes())
    raw[8 + len(raw) // 3] ^= 0x01                   # one bit inside the block
    f.write_bytes(raw)


def garbage(f: Path) -> None:
    f.write_bytes(os.urandom(f.stat().st_size))


def delete(f: Path) -> None:
    f.unlink()


def directory(f: Path) -> None:
    f.unlink()
    f.mkdir()


DAMAGES = (truncate, flip, garbage, delete, directory)


class DamagingRelay(StoreRelay):
    """Damages, before forwarding a get, the disk file of its first key held on
    disk (one kind of damage per get, in DAMAGES order, until each was done once)."""

    def __init__(self, store_addr: str, host: str, disk: Path):
        super().__init__(store_addr, host)
        self.disk = disk
        self.damaged: list[tuple[int, str]] = []       # (key, damage) in the order done

    def on_request(self, client: bytes, header: dict) -> None:
        if header.get("op") == "get" and len(self.damaged) < len(DAMAGES):
            self._damage_first_on_disk(header["keys"])

    def _damage_first_on_disk(self, keys: list[int]) -> None:
        for key in keys:
            f = self.disk / f"{key:016x}.kv"
            if f.is_file():
                damage = DAMAGES[len(self.damaged)]
                damage(f)
                self.damaged.append((key, damage.__name__))
                return


@pytest.mark.slow          # ~22 s here with its colocated reference (2 shared cores, loaded)
def test_damaged_disk_blocks_are_never_used_and_recomputed(colocated, tmp_path, capfd):  # noqa: F811
    disk = tmp_path / "disk"
    cfg = config(prefill_workers=1, decode_workers=1, enable_prefix_caching=False,
                 kvstore={"capacity_bytes": 8 * BLOCK_BYTES, "disk_capacity_bytes": 10_000 * BLOCK_BYTES,
                          "disk_path": str(disk)})
    assert cfg.model.kv_bytes_per_token * cfg.block_size == BLOCK_BYTES
    requests = build_workload(cfg.workload, cfg.model.vocab_size, cfg.seed)
    apply_sampling(cfg, requests)
    keys_of = {r.request_id: prefix_block_keys(r, cfg.block_size, r.prompt_len // cfg.block_size) for r in requests}
    fetched: dict[str, PrefixFetched] = {}
    rt = RelayedRuntime(cfg, lambda store, host: DamagingRelay(store, host, disk),
                        on_event=lambda _, ev: fetched.setdefault(ev.id, ev) if type(ev) is PrefixFetched else None)
    result = rt.run(requests)
    assert rt.relay.error is None, rt.relay.error
    assert [name for _, name in rt.relay.damaged] == [d.__name__ for d in DAMAGES], \
        "fewer gets read the disk tier than there are kinds of damage"

    assert {r.request_id: (r.status, r.error) for r in result.records} == {rid: ("finished", None) for rid in colocated}
    assert {r.request_id: r.output_token_ids for r in result.records} == colocated
    assert all(s["all_free"] for s in result.worker_stats.values()) and len(result.worker_stats) == 2
    # each damaged block cut its request's read short exactly there: the prefix before it came
    # from the store, the damaged block and everything after it were computed
    bs = cfg.block_size
    logged = capfd.readouterr().err
    short = {rid: ev for rid, ev in fetched.items() if ev.found_tokens > ev.store_tokens}
    assert len(short) == len(DAMAGES), [(ev.id, ev.found_tokens, ev.store_tokens) for ev in fetched.values()]
    for key, name in rt.relay.damaged:
        rid = next((rid for rid, ev in short.items()
                    if key in keys_of[rid] and ev.store_tokens == keys_of[rid].index(key) * bs - ev.local_tokens),
                   None)
        assert rid is not None, (name, key, short)
        ev = short.pop(rid)
        record = next(r for r in result.records if r.request_id == rid)
        assert record.num_external_cached_tokens == ev.store_tokens < ev.found_tokens
        assert f"{key:016x}.kv" in logged, f"no log line names the {name} file"       # the store's stderr
    computed = sum(it.num_prefill_tokens for it in result.iterations)
    assert computed == sum(r.prompt_len - r.num_cached_tokens for r in result.records)
    # the store lived through it, counted each damaged file, and still served intact ones from disk
    ks = result.store_stats
    assert ks is not None
    assert (ks["disk_corrupt"], ks["disk_read_errors"]) == (3, 2)
    assert ks["disk_hits"] > 0 and ks["demotions"] > 0
    # the recomputed block of the directory's name, demoted again, cannot be written there: it leaves the store
    dir_key = next(key for key, name in rt.relay.damaged if name == "directory")
    write_errors = [line for line in logged.splitlines() if "cannot write" in line]
    assert len(write_errors) == ks["disk_write_errors"]
    assert all(f"{dir_key:016x}.kv" in line for line in write_errors)
    # nothing left over: no process, and the directory put in a file's place is still ours alone
    assert multiprocessing.active_children() == []
    assert sum(p.is_dir() for p in disk.iterdir()) == 1


def test_a_disk_tier_path_the_store_cannot_make_names_the_field(tmp_path):
    """The store makes its disk tier's directory at start-up; where it cannot (a
    file in the way), the error names kvstore.disk_path and why, not the OSError alone."""
    from testbed.kv_transfer.store_service import DiskTier
    (tmp_path / "a_file").write_text("x")
    with pytest.raises(ValueError, match=r"kvstore.disk_path: cannot make '.*a_file/tier'.*NotADirectoryError"):
        DiskTier(str(tmp_path / "a_file" / "tier"))
    assert DiskTier(str(tmp_path / "new" / "tier")).path.is_dir()
