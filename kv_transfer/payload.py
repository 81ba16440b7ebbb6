"""KVPayload: one piece of one request's KV on its way from a prefill worker
to the decode worker's reserved blocks, and its wire header.

A request's KV travels as one payload (whole) or one per layer range
(layer-wise streaming, `last` marks the final piece). The data is
`cache[layer_start:layer_end, :, src_blocks]` made contiguous, shape
`[num_layers, 2, num_blocks, block_size, num_kv_heads, head_dim]`; `block_ids`
are where it goes on the receiver. On the sending side the data may instead be
`parts`: contiguous pieces whose bytes, in order, are the payload's (pack.py
view_kv: views of the cache itself, so nothing is copied before the wire). The header is msgpack (never pickle) and is
decoded defensively: every field is type- and range-checked, and the declared
size is capped before anything is allocated for the data.

The checksum (xxh3_64 of the data's bytes) is in the header, or, where the
header says `checksum: nil`, in a trailer after the data: a sender that
hashes each chunk as it hands it to the wire (the zmq transport) sends the
header at once instead of after a pass over the whole payload (~3 ms for 32
MiB here, a serial delay before the first byte).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field

import msgpack
import torch
import xxhash

from testbed.wire_text import shown

HEADER_VERSION = 2      # 2: the checksum may be nil (it follows the data)

# dtype names on the wire -> torch dtypes (a whitelist: the name comes off the network)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
    "float8_e4m3fn": torch.float8_e4m3fn, "float8_e5m2": torch.float8_e5m2,
    "int8": torch.int8, "uint8": torch.uint8,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class PayloadError(ValueError):
    """A payload (or its header) is malformed, oversized or corrupted.
    `request_id` is set when the header got far enough to name the request."""

    def __init__(self, message: str, request_id: str | None = None) -> None:
        super().__init__(message)
        self.request_id = request_id


def flat_bytes(data: torch.Tensor) -> torch.Tensor:
    """The tensor's bytes as a flat uint8 tensor, without copying."""
    if data.device.type != "cpu" or not data.is_contiguous():
        raise PayloadError(f"payload data must be a contiguous CPU tensor, got device={data.device} "
                           f"contiguous={data.is_contiguous()}; pack_kv stages GPU caches through host memory")
    return data.reshape(-1).view(torch.uint8)


def byte_view(data: torch.Tensor):
    """The tensor's bytes as a numpy array, without copying (works for
    bfloat16 and float8, which numpy cannot represent): a buffer for zmq and xxhash."""
    return flat_bytes(data).numpy()


def checksum(data: torch.Tensor) -> int:
    """xxh3_64 of the tensor's bytes (~20 GB/s on one core here)."""
    return xxhash.xxh3_64_intdigest(byte_view(data))


@dataclass
class KVPayload:
    request_id: str
    layer_start: int
    layer_end: int
    block_ids: list[int]                  # destination block ids on the receiver
    num_tokens: int                       # tokens held by these blocks
    dtype: str                            # a key of DTYPES
    shape: tuple[int, ...]                # [layers, 2, blocks, block_size, kv_heads, head_dim]
    checksum: int | None                  # xxh3_64 of the data's bytes, computed by the sender; None:
                                          # not yet (the transport hashes the bytes as it sends them)
    data: torch.Tensor                    # contiguous, CPU, of `shape` and `dtype`
    last: bool = True                     # the final piece of this request's KV
    meta: dict = field(default_factory=dict)   # small and msgpack-able (first token, timings)
    origin: str = ""                      # set by the receiver: the sender's name, for ack()
    error: str | None = None              # set by the receiver: why this payload failed
    in_place: bool = False                # set by the receiver: already written into block_ids (data empty)
    parts: list[torch.Tensor] | None = None   # sender side, instead of data: contiguous CPU pieces, in order

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def byte_parts(self) -> list:
        """The data's bytes as numpy views, in order, without copying: `parts`, or `data` whole."""
        return [byte_view(t) for t in self.parts] if self.parts is not None else [byte_view(self.data)]

    def data_checksum(self) -> int:
        """xxh3_64 of the data's bytes, `parts` or `data`, computed now."""
        hasher = xxhash.xxh3_64()
        for part in self.byte_parts():
            hasher.update(part)
        return hasher.intdigest()

    def with_checksum(self) -> KVPayload:
        """This payload with its checksum: itself when it has one, else a copy hashed now
        (for senders that cannot hash in flight, or must not wait to)."""
        return self if self.checksum is not None else dataclasses.replace(self, checksum=self.data_checksum())

    @property
    def ok(self) -> bool:
        return self.error is None

    def failed(self, error: str) -> KVPayload:
        """Mark this payload failed (the receiver's verdict); drop its data."""
        self.error = error
        self.data = torch.empty(0, dtype=torch.uint8)
        return self

    @classmethod
    def failed_header(cls, request_id: str, origin: str, error: str) -> KVPayload:
        """A failed payload for a message whose header named the request but
        was otherwise unusable."""
        return cls(request_id=request_id, layer_start=0, layer_end=0, block_ids=[], num_tokens=0,
                   dtype="uint8", shape=(0,), checksum=0, data=torch.empty(0, dtype=torch.uint8), last=True,
                   origin=origin, error=error)

    def verify(self) -> None:
        """Raise PayloadError unless data matches the header: dtype, shape,
        byte count and checksum."""
        rid = self.request_id
        if self.dtype not in DTYPES:
            raise PayloadError(f"request {rid}: unknown dtype '{self.dtype}'", rid)
        if self.data.dtype != DTYPES[self.dtype]:
            raise PayloadError(f"request {rid}: data dtype {self.data.dtype} != header dtype {self.dtype}", rid)
        if tuple(self.data.shape) != tuple(self.shape):
            raise PayloadError(f"request {rid}: data shape {tuple(self.data.shape)} != header shape "
                               f"{tuple(self.shape)}", rid)
        if self.data.nbytes != self.nbytes:
            raise PayloadError(f"request {rid}: {self.data.nbytes} data bytes != {self.nbytes} declared", rid)
        self.check_checksum(checksum(self.data))

    def check_checksum(self, digest: int) -> None:
        if self.checksum is None:
            raise PayloadError(f"request {shown(self.request_id)}: no checksum came with the data (the header "
                               "said a trailer would carry it)", self.request_id)
        if digest != self.checksum:
            raise PayloadError(f"request {shown(self.request_id)}: checksum mismatch (got {digest:#018x}, "
                               f"header says {self.checksum:#018x}): the KV was corrupted in transit",
                               self.request_id)

    def encode_header(self) -> bytes:
        return msgpack.packb({
            "v": HEADER_VERSION, "request_id": self.request_id,
            "layer_start": self.layer_start, "layer_end": self.layer_end,
            "block_ids": list(self.block_ids), "num_tokens": self.num_tokens,
            "dtype": self.dtype, "shape": list(self.shape), "checksum": self.checksum,
            "nbytes": self.nbytes, "last": self.last, "meta": self.meta,
        })


def decode_header(raw: bytes | memoryview, max_header_bytes: int, max_message_bytes: int) -> KVPayload:
    """A KVPayload with no data yet, from a header frame off the network.
    Raises PayloadError (with request_id when it was readable) on anything
    malformed, and when the declared size exceeds max_message_bytes."""
    if len(raw) > max_header_bytes:
        raise PayloadError(f"header of {len(raw)} bytes exceeds max_header_bytes={max_header_bytes}")
    try:
        h = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:  # msgpack raises several unrelated types on garbage
        raise PayloadError(f"header is not valid msgpack ({type(e).__name__}: {shown(str(e), 120)})") from None
    if not isinstance(h, dict):
        raise PayloadError(f"header is a {type(h).__name__}, expected a map")
    rid = h.get("request_id")
    if not isinstance(rid, str):
        raise PayloadError("header has no string request_id")
    name = shown(rid)                        # the peer's text: safe to print

    def want(key: str, kind: type | tuple[type, ...]):
        value = h.get(key)
        ints = kind is int or (isinstance(kind, tuple) and int in kind)
        if key not in h or not isinstance(value, kind) or (ints and isinstance(value, bool)):
            raise PayloadError(f"request {name}: header field '{key}' is {shown(repr(value))}, expected "
                               f"{' or '.join(k.__name__ for k in (kind if isinstance(kind, tuple) else (kind,)))}",
                               rid)
        return value

    if want("v", int) != HEADER_VERSION:
        raise PayloadError(f"request {name}: header version {h['v']} != {HEADER_VERSION}", rid)
    dtype = want("dtype", str)
    if dtype not in DTYPES:
        raise PayloadError(f"request {name}: dtype {shown(repr(dtype))} is not one of {sorted(DTYPES)}", rid)
    shape = want("shape", list)
    block_ids = want("block_ids", list)
    if not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
        raise PayloadError(f"request {name}: shape {shown(str(shape))} must be non-negative integers", rid)
    if not all(isinstance(b, int) and not isinstance(b, bool) and b >= 0 for b in block_ids):
        raise PayloadError(f"request {name}: block_ids must be non-negative integers", rid)
    p = KVPayload(
        request_id=rid, layer_start=want("layer_start", int), layer_end=want("layer_end", int),
        block_ids=block_ids, num_tokens=want("num_tokens", int), dtype=dtype, shape=tuple(shape),
        checksum=want("checksum", (int, type(None))),     # None: a trailer after the data carries it
        data=torch.empty(0, dtype=torch.uint8),
        last=want("last", bool), meta=want("meta", dict))
    if (len(p.shape) != 6 or p.shape[0] != p.layer_end - p.layer_start or p.shape[1] != 2
            or p.shape[2] != len(p.block_ids) or p.layer_start < 0):
        raise PayloadError(f"request {name}: shape {shown(str(shape))} does not match layers "
                           f"[{p.layer_start}, {p.layer_end}) x (k, v) x {len(p.block_ids)} blocks", rid)
    if p.nbytes == 0:
        raise PayloadError(f"request {name}: shape {shown(str(shape))} holds no data", rid)
    if want("nbytes", int) != p.nbytes:
        raise PayloadError(f"request {name}: nbytes={h['nbytes']} does not match shape {shown(str(shape))} "
                           f"of {dtype}", rid)
    if p.nbytes > max_message_bytes:
        raise PayloadError(f"request {name}: payload of {p.nbytes} bytes exceeds max_message_bytes="
                           f"{max_message_bytes}", rid)
    return p
