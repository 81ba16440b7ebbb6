"""The KV store's wire format (store_service.py <-> store_client.py).

A request or reply is one zmq multipart message: a msgpack header (never
pickle), then one data frame per block it carries (zero-copy on the sending
side). Headers are maps checked field by field on decode: whatever a peer
sends, a malformed message is a `StoreWireError`, never a crash.

  contains {op, id, keys}                 -> {id, ok, n}: leading keys stored
  get      {op, id, keys}                 -> {id, ok, blocks: [[key, checksum, nbytes]]} + frames
  put      {op, id, blocks: [[key, checksum, nbytes]]} + frames
                                          -> {id, ok, stored, rejected, corrupt}
  stats    {op, id}                       -> {id, ok, counters, num_blocks, used_bytes}
Keys are the BlockManager's 64-bit chained prefix hashes; checksums xxh3_64
of a block's bytes, computed by whoever sends them and verified by whoever
receives them.
"""
from __future__ import annotations

import msgpack
import xxhash

OPS = ("contains", "get", "put", "stats")
MAX_HEADER_BYTES = 4 << 20        # ~250K keys: a 4M-token prompt of 16-token blocks
_U64 = (1 << 64) - 1


class StoreWireError(ValueError):
    """A store message that could not be decoded; the text says why."""


def block_checksum(data) -> int:
    return xxhash.xxh3_64_intdigest(data)


def encode(header: dict) -> bytes:
    return msgpack.packb(header, use_bin_type=True)


def decode(raw: bytes | memoryview) -> dict:
    if len(raw) > MAX_HEADER_BYTES:
        raise StoreWireError(f"header of {len(raw)} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:       # msgpack raises several unrelated types on garbage
        raise StoreWireError(f"not a msgpack header ({type(e).__name__}: {e})") from None
    if not isinstance(h, dict):
        raise StoreWireError(f"header is a {type(h).__name__}, expected a map")
    if not _is_int(h.get("id")):
        raise StoreWireError("header has no integer id")
    return h


def check_request(h: dict, num_frames: int) -> str:
    """The request's op, after checking its fields against `num_frames` data frames."""
    op = h.get("op")
    if op not in OPS:
        raise StoreWireError(f"unknown op {str(op)[:20]!r}; expected one of {OPS}")
    if op in ("contains", "get"):
        keys(h, "keys")
        if num_frames:
            raise StoreWireError(f"{op} carries no data, got {num_frames} frames")
    elif op == "put":
        if len(blocks(h)) != num_frames:
            raise StoreWireError(f"put declares {len(h['blocks'])} blocks but carries {num_frames} frames")
    return op


def keys(h: dict, field: str) -> list[int]:
    value = h.get(field)
    if not isinstance(value, list) or not all(_is_int(k) and 0 <= k <= _U64 for k in value):
        raise StoreWireError(f"'{field}' must be a list of 64-bit keys")
    return value


def blocks(h: dict) -> list[tuple[int, int, int]]:
    """[(key, checksum, nbytes)] of a put request or a get reply."""
    value = h.get("blocks")
    if not isinstance(value, list):
        raise StoreWireError("'blocks' must be a list of [key, checksum, nbytes]")
    out = []
    for b in value:
        if not (isinstance(b, list) and len(b) == 3 and all(_is_int(x) and 0 <= x <= _U64 for x in b)):
            raise StoreWireError("'blocks' must be a list of [key, checksum, nbytes]")
        out.append((b[0], b[1], b[2]))
    return out


def reply_int(h: dict, field: str) -> int:
    value = h.get(field)
    if not _is_int(value) or value < 0:
        raise StoreWireError(f"reply field '{field}' is {value!r}, expected a count")
    return value


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)
