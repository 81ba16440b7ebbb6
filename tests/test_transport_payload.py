"""KVPayload, its header, pack_kv/unpack_kv and TransferConfig: in-process,
exact values."""
from __future__ import annotations

import dataclasses

import msgpack
import pytest
import torch
import xxhash

from testbed.kv_transfer import (KVPayload, PayloadError, TransferConfig, coalesce_runs, make_sender,
                                 pack_kv, unpack_kv, view_kv)
from testbed.kv_transfer.payload import HEADER_VERSION, decode_header

L, NB, BS, H, D = 3, 40, 4, 2, 8


def make_cache(dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(L, 2, NB, BS, H, D, generator=g).to(dtype)


def test_coalesce_runs():
    assert coalesce_runs([4, 5, 6, 9, 2, 3]) == [(4, 3), (9, 1), (2, 2)]
    assert coalesce_runs([7]) == [(7, 1)]
    assert coalesce_runs([3, 2, 1]) == [(3, 1), (2, 1), (1, 1)]
    assert coalesce_runs([]) == []


@pytest.mark.parametrize("src,dst", [
    ([7, 8, 9, 2, 30, 31], [0, 1, 12, 13, 14, 39]),                    # few runs: sliced
    (list(range(0, 40, 2)), list(range(39, 19, -1))),                 # 20 runs: one index_select/index_copy
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_pack_unpack_places_blocks_at_destination(src, dst, dtype):
    cache = make_cache(dtype)
    p = pack_kv(cache, (1, 3), src, dst, num_tokens=len(src) * BS - 1, request_id="r1", last=False,
                meta={"first_token": 5})
    assert p.shape == (2, 2, len(src), BS, H, D) and p.dtype == str(dtype).removeprefix("torch.")
    assert torch.equal(p.data, cache[1:3][:, :, src])
    assert p.checksum == xxhash.xxh3_64_intdigest(p.data.reshape(-1).view(torch.uint8).numpy())
    assert p.block_ids == dst and p.last is False and p.meta == {"first_token": 5}
    p.verify()

    out = torch.zeros_like(cache)
    unpack_kv(out, p)
    for s, d in zip(src, dst):
        assert torch.equal(out[1:3, :, d], cache[1:3, :, s])
    written = torch.zeros(NB, dtype=torch.bool)
    written[dst] = True
    assert not out[:, :, ~written].any() and not out[0].any()     # nothing else touched


@pytest.mark.parametrize("src", [[7, 8, 9, 2, 30, 31], [5], list(range(NB))])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_view_kv_is_pack_kv_without_the_copy(src, dtype):
    cache = make_cache(dtype)
    dst = list(range(len(src)))
    packed = pack_kv(cache, (1, 3), src, dst, len(src) * BS - 1, "r", meta={"first_token": 5})
    viewed = view_kv(cache, (1, 3), src, dst, len(src) * BS - 1, "r", meta={"first_token": 5})
    # the same header, but the checksum is left to the sender (zmq sends it after the data)
    assert viewed.checksum is None and viewed.data_checksum() == packed.checksum
    assert dataclasses.replace(viewed, checksum=packed.checksum).encode_header() == packed.encode_header()
    joined = torch.cat([torch.from_numpy(b) for b in viewed.byte_parts()])
    assert torch.equal(joined, packed.data.reshape(-1).view(torch.uint8))
    assert len(viewed.parts) == 2 * 2 * len(coalesce_runs(src))      # (layer, k/v, run)
    lo, hi = cache.data_ptr(), cache.data_ptr() + cache.nbytes      # views of the cache: nothing copied
    assert all(lo <= part.data_ptr() < hi for part in viewed.parts)


def test_view_kv_leaves_scattered_blocks_to_pack_kv():
    cache = make_cache()
    assert view_kv(cache, (0, 3), list(range(0, 40, 2)), list(range(20)), 20, "r") is None   # 20 runs
    with pytest.raises(ValueError, match="out of range"):
        view_kv(cache, (0, 3), [NB], [0], 1, "r")


def test_pack_into_preallocated_buffer_shares_its_memory():
    cache = make_cache()
    out = torch.empty(1 << 20, dtype=torch.uint8)
    p = pack_kv(cache, (0, 3), [5, 6], [1, 2], 8, "r", out=out)
    assert p.data.data_ptr() == out.data_ptr()
    assert torch.equal(p.data, cache[:, :, 5:7])
    with pytest.raises(ValueError, match="out must be a contiguous CPU uint8 buffer of >= 3072 bytes"):
        pack_kv(cache, (0, 3), [5, 6], [1, 2], 8, "r", out=torch.empty(100, dtype=torch.uint8))


def test_pack_rejects_bad_arguments():
    cache = make_cache()
    with pytest.raises(ValueError, match=r"layers=\(2, 2\) is not a non-empty range"):
        pack_kv(cache, (2, 2), [1], [1], 1, "r")
    with pytest.raises(ValueError, match="2 source and 1 destination block ids"):
        pack_kv(cache, (0, 1), [1, 2], [1], 1, "r")
    with pytest.raises(ValueError, match="num_tokens=9 does not fit 2 blocks of 4"):
        pack_kv(cache, (0, 1), [1, 2], [1, 2], 9, "r")
    with pytest.raises(PayloadError, match=r"src_block_ids \[40\] out of range"):
        pack_kv(cache, (0, 1), [40], [1], 1, "r")


def test_verify_failures():
    p = pack_kv(make_cache(), (0, 2), [1, 2, 3], [4, 5, 6], 12, "req-7")
    p.verify()
    bad = dataclasses.replace(p, data=p.data.clone())
    bad.data.view(-1)[17] += 1.0
    with pytest.raises(PayloadError, match="request req-7: checksum mismatch .* corrupted in transit"):
        bad.verify()
    with pytest.raises(PayloadError, match=r"data shape \(2, 2, 2, 4, 2, 8\) != header shape"):
        dataclasses.replace(p, data=p.data[:, :, :2].contiguous()).verify()
    with pytest.raises(PayloadError, match="data dtype torch.float16 != header dtype float32"):
        dataclasses.replace(p, data=p.data.half()).verify()
    with pytest.raises(PayloadError, match="must be a contiguous CPU tensor"):
        dataclasses.replace(p, data=p.data.transpose(0, 1)).verify()


def test_header_round_trip():
    p = pack_kv(make_cache(), (1, 2), [3, 4], [9, 8], 7, "req-1", last=False, meta={"t": [1.5, 2]})
    q = decode_header(p.encode_header(), 65536, 1 << 20)
    for f in ("request_id", "layer_start", "layer_end", "block_ids", "num_tokens", "dtype", "shape",
              "checksum", "last", "meta"):
        assert getattr(q, f) == getattr(p, f), f
    assert q.nbytes == p.nbytes == 1 * 2 * 2 * BS * H * D * 4


def _header(**overrides) -> bytes:
    h = {"v": HEADER_VERSION, "request_id": "r9", "layer_start": 0, "layer_end": 1, "block_ids": [3], "num_tokens": 4,
         "dtype": "float32", "shape": [1, 2, 1, BS, H, D], "checksum": 0, "nbytes": 2 * BS * H * D * 4,
         "last": True, "meta": {}}
    h.update(overrides)
    return msgpack.packb(h)


@pytest.mark.parametrize("raw,message,request_id", [
    (b"\xc1garbage", "not valid msgpack", None),
    (msgpack.packb([1, 2]), "header is a list, expected a map", None),
    (_header(request_id=5), "no string request_id", None),
    (_header(layer_start="0"), "request r9: header field 'layer_start' is '0', expected int", "r9"),
    (_header(last=1), "header field 'last' is 1, expected bool", "r9"),
    (_header(dtype="complex128"), "dtype 'complex128' is not one of", "r9"),
    (_header(block_ids=[3, -1]), "block_ids must be non-negative integers", "r9"),
    (_header(shape=[1, 2, 2, BS, H, D]), r"does not match layers \[0, 1\) x \(k, v\) x 1 blocks", "r9"),
    (_header(nbytes=7), "nbytes=7 does not match shape", "r9"),
    (_header(v=1), "header version 1 != 2", "r9"),
    (_header(checksum=True), "header field 'checksum' is True, expected int or NoneType", "r9"),
    (_header(checksum="0"), "header field 'checksum' is '0', expected int or NoneType", "r9"),
    (_header(shape=[1, 2, 1, 1 << 20, H, D], nbytes=(1 << 20) * H * D * 8),
     "payload of 134217728 bytes exceeds max_message_bytes=1048576", "r9"),
])
def test_decode_header_rejects(raw, message, request_id):
    with pytest.raises(PayloadError, match=message) as e:
        decode_header(raw, 65536, 1 << 20)
    assert e.value.request_id == request_id


def test_decode_header_rejects_oversize_header_before_parsing():
    raw = _header(meta={"pad": "x" * 70000})
    with pytest.raises(PayloadError, match=f"header of {len(raw)} bytes exceeds max_header_bytes=65536"):
        decode_header(raw, 65536, 1 << 20)


def test_unpack_rejects_what_the_cache_cannot_take():
    cache = make_cache()
    p = pack_kv(cache, (0, 2), [1, 2], [4, 5], 8, "r3")
    with pytest.raises(PayloadError, match=r"request r3: block_ids \[40\] out of range"):
        unpack_kv(cache, dataclasses.replace(p, block_ids=[4, 40]))
    with pytest.raises(PayloadError, match="block_ids has duplicates"):
        unpack_kv(cache, dataclasses.replace(p, block_ids=[4, 4]))
    with pytest.raises(PayloadError, match="payload dtype float32 != cache dtype torch.float16"):
        unpack_kv(cache.half(), p)
    with pytest.raises(PayloadError, match=r"payload blocks \(4, 2, 8\) != cache blocks \(8, 2, 4\)"):
        unpack_kv(torch.zeros(L, 2, NB, 8, H, 4), p)
    with pytest.raises(PayloadError, match="refusing to unpack a failed payload"):
        unpack_kv(cache, dataclasses.replace(p).failed("checksum mismatch"))


@pytest.mark.parametrize("field,value,message", [
    ("transport", "rdma", "transfer.transport: 'rdma' is not one of zmq, torch_dist, shaped"),
    ("shaped_inner", "shaped", "transfer.shaped_inner: 'shaped' is not one of zmq, torch_dist"),
    ("protocol", "udp", "transfer.protocol: 'udp' is not one of tcp, ipc"),
    ("rate_gbps", 0.0, "transfer.rate_gbps: must be > 0"),
    ("latency_ms", -1.0, "transfer.latency_ms: must be >= 0"),
    ("frame_bytes", 100, "transfer.frame_bytes: must be >= 4096"),
    ("socket_buffer_bytes", -1, "transfer.socket_buffer_bytes: must be >= 0"),
    ("max_message_bytes", 4096, "transfer.max_message_bytes: 4096 must be >= frame_bytes"),
    ("timeout_s", 0.0, "transfer.timeout_s: must be > 0"),
    ("dist_backend", "mpi", "transfer.dist_backend: 'mpi' is not one of gloo, nccl"),
    ("fault_corrupt_nth", -1, "transfer.fault_corrupt_nth: must be >= 0"),
])
def test_config_validation_names_the_field(field, value, message):
    TransferConfig().validate()
    with pytest.raises(ValueError, match=message):
        TransferConfig(**{field: value}).validate()


def test_torch_dist_needs_a_group():
    with pytest.raises(ValueError, match="transport=torch_dist needs the worker's TorchDistGroup"):
        make_sender(TransferConfig(transport="torch_dist"))


def test_failed_payload_drops_data():
    p = pack_kv(make_cache(), (0, 1), [1], [2], 4, "r").failed("bad")
    assert not p.ok and p.error == "bad" and p.data.numel() == 0
    assert KVPayload.failed_header("r", "p0", "why").origin == "p0"
