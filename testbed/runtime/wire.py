"""The one wire encoding of a Message (testbed/runtime/messages.py): a msgpack
array `[kind, field, field, ...]` in the dataclass's field order, nested
dataclasses (a RequestMsg, an IterationRecord) as arrays the same way. Never
pickle: decoding builds only the dataclasses named here.

`decode` rejects anything else with a `WireError` that says what was wrong:
bytes that are not msgpack, an unknown kind, the wrong number of fields, a
field of the wrong type. It runs on every message a real frontend or worker
reads, from any local peer, so it checks everything and trusts nothing."""
from __future__ import annotations

import collections.abc
import dataclasses
import types
import typing
from functools import lru_cache
from typing import Any, Callable

import msgpack

from testbed.runtime.messages import MESSAGES, HandOffMeta, Message

MAX_MESSAGE_BYTES = 64 << 20   # a command carries at most one prompt (8 MiB of ids for 1M tokens as int64)


class WireError(ValueError):
    """A message that could not be decoded; the text says why."""


def encode(msg: Message) -> bytes:
    return msgpack.packb(_to_wire(msg), use_bin_type=True)


def _to_wire(obj: Any) -> Any:
    if dataclasses.is_dataclass(obj):
        values = [_to_wire(getattr(obj, f.name)) for f in dataclasses.fields(obj)]
        return [obj.kind, *values] if isinstance(obj, Message) else values
    if isinstance(obj, tuple):
        return [_to_wire(v) for v in obj]
    if isinstance(obj, list):
        return obj if not obj or not dataclasses.is_dataclass(obj[0]) else [_to_wire(v) for v in obj]
    if hasattr(obj, "tolist"):        # a numpy prompt
        return obj.tolist()
    return obj


def decode(raw: bytes | memoryview) -> Message:
    if len(raw) > MAX_MESSAGE_BYTES:
        raise WireError(f"message of {len(raw)} bytes exceeds {MAX_MESSAGE_BYTES}")
    try:
        obj = msgpack.unpackb(raw, raw=False, strict_map_key=True)
    except Exception as e:     # msgpack raises several unrelated types on garbage
        raise WireError(f"not a msgpack message ({type(e).__name__}: {e})") from None
    if not isinstance(obj, list) or not obj or not isinstance(obj[0], str):
        raise WireError(f"expected [kind, fields...], got a {type(obj).__name__}")
    cls = MESSAGES.get(obj[0])
    if cls is None:
        raise WireError(f"unknown message kind {obj[0][:40]!r}")
    return check_fields(cls, obj[1:])


def hand_off_meta(d: dict) -> HandOffMeta:
    """The hand-off metadata of a KV payload's header, checked like a message."""
    if not isinstance(d, dict):
        raise WireError(f"hand-off metadata is a {type(d).__name__}, expected a map")
    return check_fields(HandOffMeta, [d.get(name) for name in HandOffMeta.__dataclass_fields__])


def check_fields(cls: type, values: list, where: str | None = None) -> Any:
    """An instance of dataclass `cls` from its field values, each checked against its annotation."""
    where = where or _name(cls)
    checkers = _checkers(cls)
    if len(values) != len(checkers):
        raise WireError(f"{where}: expected {len(checkers)} fields, got {len(values)}")
    return cls(*[check(v, f"{where}.{name}") for (name, check), v in zip(checkers, values)])


def _name(cls: type) -> str:
    return getattr(cls, "kind", cls.__name__)


@lru_cache(maxsize=None)
def _checkers(cls: type) -> tuple[tuple[str, Callable[[Any, str], Any]], ...]:
    hints = typing.get_type_hints(cls)
    return tuple((f.name, _checker(hints[f.name])) for f in dataclasses.fields(cls))


def _checker(tp: Any) -> Callable[[Any, str], Any]:
    """A function (value, where) -> value converted to `tp`, or WireError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        options = [_checker(a) for a in args if a is not type(None)]
        optional = type(None) in args

        def union(v, where):
            if v is None and optional:
                return None
            for check in options:
                try:
                    return check(v, where)
                except WireError:
                    pass
            raise WireError(f"{where}: {v!r:.60} is not a {tp}")
        return union
    if origin in (list, collections.abc.Sequence):
        item = _checker(args[0]) if args else (lambda v, where: v)
        if args and args[0] is int:
            def int_list(v, where):
                if not isinstance(v, list) or not all(type(x) is int for x in v):
                    raise WireError(f"{where}: expected a list of integers")
                return v
            return int_list

        def a_list(v, where):
            if not isinstance(v, list):
                raise WireError(f"{where}: expected a list, got {type(v).__name__}")
            return [item(x, f"{where}[{i}]") for i, x in enumerate(v)]
        return a_list
    if origin is tuple:
        items = [_checker(a) for a in args]

        def a_tuple(v, where):
            if not isinstance(v, list) or len(v) != len(items):
                raise WireError(f"{where}: expected {len(items)} items")
            return tuple(check(x, where) for check, x in zip(items, v))
        return a_tuple
    if dataclasses.is_dataclass(tp):
        def nested(v, where):
            if not isinstance(v, list):
                raise WireError(f"{where}: expected a {tp.__name__} as a list")
            return check_fields(tp, v, where)
        return nested
    if tp is float:
        def a_float(v, where):
            if type(v) not in (float, int):
                raise WireError(f"{where}: expected a number, got {type(v).__name__}")
            if v != v:
                raise WireError(f"{where}: NaN is not a value here")
            return float(v)
        return a_float
    if tp in (int, str, bool):
        def exact(v, where):
            if type(v) is not tp:
                raise WireError(f"{where}: expected {tp.__name__}, got {type(v).__name__}")
            return v
        return exact
    raise TypeError(f"no wire checker for {tp}")
