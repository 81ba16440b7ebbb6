"""shown(): a string or bytes that came off the network, made safe to print.

A peer picks its own routing id (the sender's name on a ROUTER socket), the
request ids in its headers and the bytes of any frame it sends. Printed as
they are, they put control characters, line breaks (a forged log line) or
kilobytes of binary into the log. Printable text up to `limit` characters is
shown as it is, so ordinary names read as before; longer text is cut and says
how long it was; anything else is shown as hex of its bytes.
"""
from __future__ import annotations


def shown(value: str | bytes, limit: int = 64) -> str:
    """'prefill-0' -> 'prefill-0'; b'\\x00k\\x8bEg' -> '0x006b8b4567';
    a 5,000-character name -> its first `limit` characters and '...(5000 chars)'."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        try:
            value = raw.decode("utf-8")
        except UnicodeDecodeError:
            return _hex(raw, limit)
    if value and value.isprintable():
        return value if len(value) <= limit else f"{value[:limit]}...({len(value)} chars)"
    return _hex(value.encode("utf-8", "surrogateescape"), limit) if value else "''"


def _hex(raw: bytes, limit: int) -> str:
    head = raw[:max(1, limit // 2)]
    more = f"...({len(raw)} bytes)" if len(head) < len(raw) else ""
    return f"0x{head.hex()}{more}"
