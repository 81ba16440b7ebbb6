"""SyntheticTokens: a prompt's token ids computed on demand, never stored.

The simulator runs 100K-request workloads with prompts up to 1M tokens; a list
of Python ints costs ~36 bytes a token, so prompts are lazy. Token i of a prompt
is a hash of (stream key, block id, offset in block), reduced modulo the vocab:

- a prompt of its own has a per-request key and block ids 0, 1, 2, ...;
- a prompt made of shared blocks (Mooncake `hash_ids`) uses the workload's shared
  key and the trace's block ids, so two requests naming the same block get the
  same tokens there, which is what lets prefix caching and the KV store hit.

The engine asks for slices (lists) or `numpy()` (an int64 array for a tensor);
nothing else ever materializes the whole prompt.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_ITER_CHUNK = 4096


def _mix_int(x: int) -> int:
    """splitmix64's finalizer on a Python int: a bijective 64-bit scramble."""
    x &= _MASK64
    x = ((x ^ (x >> 30)) * _MIX1) & _MASK64
    x = ((x ^ (x >> 27)) * _MIX2) & _MASK64
    return x ^ (x >> 31)


# the constants as numpy scalars, made once: building one costs about as much
# as a whole operation on a short slice
_U30, _U27, _U31 = np.uint64(30), np.uint64(27), np.uint64(31)
_U_GOLDEN, _U_MIX1, _U_MIX2 = np.uint64(_GOLDEN), np.uint64(_MIX1), np.uint64(_MIX2)


def _mix_array(x: np.ndarray) -> np.ndarray:
    """The same finalizer over a uint64 array (multiplication wraps mod 2^64),
    in place: `x` must be an array of the caller's own (it is returned)."""
    shifted = np.right_shift(x, _U30)
    x ^= shifted
    x *= _U_MIX1
    x ^= np.right_shift(x, _U27, out=shifted)
    x *= _U_MIX2
    x ^= np.right_shift(x, _U31, out=shifted)
    return x


def stream_key(*parts: int) -> int:
    """A 64-bit key from a few integers (seed, purpose, request index)."""
    key = 0
    for p in parts:
        key = _mix_int(key * _GOLDEN + (p & _MASK64) + 1)
    return key


class SyntheticTokens(Sequence):
    """An immutable, lazily computed sequence of `length` token ids in [0, vocab_size).

    `block_ids=None` means blocks 0, 1, 2, ... (a prompt nobody shares);
    otherwise block j of the prompt is the block named `block_ids[j]`."""

    __slots__ = ("_key", "_length", "_vocab_size", "_block_size", "_block_ids", "_blocks")

    def __init__(self, key: int, length: int, vocab_size: int,
                 block_ids: Sequence[int] | None = None, block_size: int = 512) -> None:
        if length < 0:
            raise ValueError(f"SyntheticTokens: length={length} must be >= 0")
        if vocab_size < 1:
            raise ValueError(f"SyntheticTokens: vocab_size={vocab_size} must be >= 1")
        if block_size < 1:
            raise ValueError(f"SyntheticTokens: block_size={block_size} must be >= 1")
        self._key = key & _MASK64
        self._length = length
        self._vocab_size = vocab_size
        self._block_size = block_size
        self._block_ids = None if block_ids is None else tuple(int(b) for b in block_ids)
        self._blocks = None
        if self._block_ids is not None:
            needed = -(-length // block_size)
            if len(self._block_ids) < needed:
                raise ValueError(f"SyntheticTokens: {length} tokens need {needed} blocks of "
                                 f"{block_size}, got {len(self._block_ids)} block ids")
            # Block ids may be any int (trace hashes); keep their low 64 bits.
            self._blocks = np.array([b & _MASK64 for b in self._block_ids], dtype=np.uint64)

    # --- what the engine uses -------------------------------------------------
    def numpy(self, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens [start, stop) as an int64 array (clamped to the sequence)."""
        stop = self._length if stop is None else min(stop, self._length)
        start = max(0, start)
        if stop <= start:
            return np.empty(0, dtype=np.int64)
        bs = self._block_size
        first, last = start // bs, (stop - 1) // bs
        block = (np.arange(first, last + 1, dtype=np.uint64) if self._blocks is None
                 else self._blocks[first:last + 1])
        # one seed per block, and each token adds its offset inside the block:
        # [num_blocks, block_size] over whole blocks, cut to [start, stop)
        seed = block * _U_GOLDEN
        seed ^= np.uint64(self._key)
        seed = _mix_array(seed)
        offset = np.arange(bs, dtype=np.uint64)
        offset *= _U_MIX1
        h = (seed[:, None] + offset).ravel()[start - first * bs:stop - first * bs]
        h = _mix_array(h)
        # token ids are below vocab_size < 2^63: the int64 view has the same values
        return np.remainder(h, np.uint64(self._vocab_size), out=h).view(np.int64)

    def __array__(self, dtype: Any = None, copy: Any = None) -> np.ndarray:
        arr = self.numpy()
        return arr if dtype is None else arr.astype(dtype)

    def to_spec(self) -> dict:
        """Plain values (msgpack/JSON friendly) from which `from_spec` rebuilds it."""
        return {"key": self._key, "length": self._length, "vocab_size": self._vocab_size,
                "block_size": self._block_size,
                "block_ids": None if self._block_ids is None else list(self._block_ids)}

    @classmethod
    def from_spec(cls, spec: dict) -> SyntheticTokens:
        return cls(spec["key"], spec["length"], spec["vocab_size"], spec["block_ids"], spec["block_size"])

    # --- Sequence protocol ------------------------------------------------------
    def __len__(self) -> int:
        return self._length

    def __getitem__(self, index):
        if isinstance(index, slice):
            start, stop, step = index.indices(self._length)
            if step == 1:
                return self.numpy(start, stop).tolist()
            idx = range(start, stop, step)
            if not idx:
                return []
            lo, hi = min(idx[0], idx[-1]), max(idx[0], idx[-1]) + 1
            return self.numpy(lo, hi)[np.asarray(idx) - lo].tolist()
        i = int(index)
        if i < 0:
            i += self._length
        if not 0 <= i < self._length:
            raise IndexError(f"token index {index} out of range for length {self._length}")
        return int(self.numpy(i, i + 1)[0])

    def __iter__(self):
        for start in range(0, self._length, _ITER_CHUNK):
            yield from self.numpy(start, start + _ITER_CHUNK).tolist()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, SyntheticTokens) and self._same_recipe(other):
            return True
        if not isinstance(other, (Sequence, np.ndarray)) or isinstance(other, (str, bytes)):
            return NotImplemented
        if len(other) != self._length:
            return False
        return bool(np.array_equal(self.numpy(), np.asarray(other, dtype=np.int64)))

    __hash__ = None  # equal to lists with the same tokens, and lists are not hashable

    def _same_recipe(self, other: SyntheticTokens) -> bool:
        return (self._key, self._length, self._vocab_size, self._block_size, self._block_ids) == \
               (other._key, other._length, other._vocab_size, other._block_size, other._block_ids)

    # `prompt + outputs` materializes a list, as list + list would.
    def __add__(self, other):
        return list(self) + list(other)

    def __radd__(self, other):
        return list(other) + list(self)

    def __repr__(self) -> str:
        shared = "" if self._block_ids is None else f", shared_blocks={len(self._block_ids)}"
        return f"SyntheticTokens(len={self._length}, vocab={self._vocab_size}{shared})"


def synthesize_prompt(seed: int, request_index: int, length: int, vocab_size: int,
                      hash_ids: Sequence[int] | None = None, block_size: int = 512) -> SyntheticTokens:
    """The prompt for request `request_index` of a workload seeded with `seed`.
    With `hash_ids`, block j of the prompt is shared by every request naming
    hash_ids[j] (same seed); without, the prompt is the request's own."""
    if hash_ids is None:
        return SyntheticTokens(stream_key(seed, 1, request_index), length, vocab_size, None, block_size)
    return SyntheticTokens(stream_key(seed, 2), length, vocab_size, hash_ids, block_size)


def private_from(hash_ids: Sequence[int] | None, block_size: int,
                 uses: Mapping[int, int] | None) -> int | None:
    """The token from which a prompt is its request's own (Request.private_from):
    0 without `hash_ids` (a stream of its own; `uses` unread, None where the
    workload names no ids); with them, the start of its first block whose id no
    other block of the workload names (`uses`: how many times each id is named
    across the workload), None where every block's id is named again."""
    if hash_ids is None:
        return 0
    for j, block_id in enumerate(hash_ids):
        if uses[block_id] == 1:
            return j * block_size
    return None


def hash_id_uses(hash_id_lists: Iterable[Sequence[int] | None]) -> Counter:
    """How many times each block id is named across a workload's prompts."""
    return Counter(block_id for ids in hash_id_lists if ids is not None for block_id in ids)
