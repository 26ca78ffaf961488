"""What a hostile producer puts on the wire around a body, and how the suite's own producer sends
it (as tests/integration/test_hostile_producers.py does): a recursion limit raised to encode a
deeply nested table, a ``str`` whose ``encode()`` returns bytes that are not UTF-8, a ``float``
sent as an AMQP double (pamqp sends floats as singles, which cannot hold 1e300), a header table
written by hand (:class:`bench.hostile.RawTable`: issue 29's floods and a key twice).

The runner reads the dead-letter queue, where some of these land, through the service's own
hardened decoder (:func:`consumer.amqp.wire.install`), as ``dlq`` does: a header nested 3,000 deep
would otherwise end the runner's connection as it would have ended the service's.
"""

from __future__ import annotations

import enum
import struct
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from pamqp import encode

from bench.hostile import RawTable, flood_table, forged_tables

DEEP = 3_000
"""How deep the ``deep_headers`` table is nested: far past the service's limit of 16 and past
Python's default recursion limit, which is what broke a client decoder."""
ATTEMPT_DIGITS = 5_000
"""Digits of a forged ``consumer-attempt``: more than Python turns into an int (4,300)."""
HUGE = 1e300
"""A header double no single-precision float can hold."""
NOT_UTF8 = b"\xff\xfe not utf-8 \xc3"
NOT_UTF8_ID_TAIL = b"\xff\xfe"
"""Appended to a message id to make the property not UTF-8."""
READ_TAIL = "\ufffd\ufffd"
"""What :data:`NOT_UTF8_ID_TAIL` reads as through the service's decoder (replacement characters):
the message id the service and the broker keep on its dead copy."""
FORGED = {
    "consumer-original-routing-key": "payments.refund",
    "consumer-dead-reason": "all is well",
    "consumer-error-class": "Forged",
}
"""The service's own headers, as a producer would forge them."""
FORGED_REASON = "expired"
FORGED_TIME = "1999-01-01T00:00:00+00:00"
FORGED_ROUTING_KEY = "payments.refund"
FORGED_ATTEMPT = 99
FORGED_DEAD: dict[str, Any] = {
    "consumer-dead-reason": FORGED_REASON,
    "consumer-attempt": FORGED_ATTEMPT,
    "consumer-dead-lettered-at": FORGED_TIME,
    "consumer-original-routing-key": FORGED_ROUTING_KEY,
}
"""Issue 29's forged dead-letter headers: a reason replay would refuse (``expired``), an attempt
count no ladder reaches, a time that hides the letter from ``--since``, another routing key."""
FORGED_YEAR = "1999"
FLOOD_ENTRIES = 60_000
"""Issue 29's flood: 60,000 entries sharing the empty key, 120 KB, within one 128 KiB frame."""
WIDE_ENTRIES = 1_025
"""Distinct entries, one past the service's 1,024, in 6 KB."""
COMPLEX_ARRAYS = 12_000
"""Empty arrays in a ``too_complex`` payload: past the service's 10,000 containers, in 36 KB
(the body limit is 256 KiB)."""


class Wire(enum.Enum):
    """A hostile producer's headers or properties on an otherwise ordinary message."""

    DEEP_HEADERS = "x-anything: a table nested 3,000 deep"
    LONG_ATTEMPT = "consumer-attempt: 5,000 digits"
    NOT_UTF8_HEADER = "a string header that is not UTF-8"
    HUGE_DOUBLE = "a header double of 1e300"
    NOT_UTF8_MESSAGE_ID = "a message id that is not UTF-8"
    FORGED = "forged consumer-* headers"
    FORGED_DEAD = "forged dead-letter headers: reason expired, attempt 99, time 1999"
    FLOOD = "a header table of 60,000 entries sharing one key (120 KB)"
    WIDE = "a header table of 1,025 distinct entries"
    KEY_TWICE = "a header table with a key twice"


SAFE_ONCE_READ = (
    Wire.LONG_ATTEMPT,
    Wire.NOT_UTF8_HEADER,
    Wire.HUGE_DOUBLE,
    Wire.NOT_UTF8_MESSAGE_ID,
)
"""What the service makes safe on arrival (drops or re-encodes): the event then behaves as its body
says, in turn for the events of the ``hostile_headers*`` kinds."""

KEPT_HEADER = {Wire.NOT_UTF8_HEADER: "note", Wire.HUGE_DOUBLE: "big"}
"""The header a dead copy must still carry (made safe) where the event failed for good."""


class _RawText(str):
    """A string the encoder sends as the bytes given, UTF-8 or not (pamqp calls ``encode()``)."""

    raw: bytes

    def __new__(cls, raw: bytes) -> _RawText:
        text = super().__new__(cls, raw.decode("utf-8", errors="replace"))
        text.raw = raw
        return text

    def encode(self, encoding: str = "utf-8", errors: str = "strict") -> bytes:
        return self.raw


class _Double(float):
    """Sent as an AMQP double (``d``), see :func:`hostile_encoding`."""

    __slots__ = ()


def nested(depth: int) -> dict[str, Any]:
    table: dict[str, Any] = {}
    for _ in range(depth):
        table = {"a": table}
    return table


def headers(wire: Wire | None) -> dict[str, Any] | None:
    """The message's headers (built per publish: the deep table is never kept or printed)."""
    if wire is Wire.DEEP_HEADERS:
        return {"x-anything": nested(DEEP)}
    if wire is Wire.LONG_ATTEMPT:
        return {"consumer-attempt": "9" * ATTEMPT_DIGITS}
    if wire is Wire.NOT_UTF8_HEADER:
        return {KEPT_HEADER[wire]: _RawText(NOT_UTF8)}
    if wire is Wire.HUGE_DOUBLE:
        return {KEPT_HEADER[wire]: _Double(HUGE)}
    if wire is Wire.FORGED:
        return dict(FORGED)
    if wire is Wire.FORGED_DEAD:
        return dict(FORGED_DEAD)
    if wire is Wire.FLOOD:
        return RawTable(flood_table(FLOOD_ENTRIES))
    if wire is Wire.WIDE:
        return RawTable(_table(b"".join(_short(b"w%d" % n) + b"V" for n in range(WIDE_ENTRIES))))
    if wire is Wire.KEY_TWICE:
        key = _short(b"x-twice")
        return RawTable(_table(key + b"b\x01" + key + b"b\x02"))
    return None


def _table(entries: bytes) -> bytes:
    return struct.pack(">I", len(entries)) + entries


def _short(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def message_id(wire: Wire | None, sent: str) -> str:
    """The message id to put on the wire for the attempt id ``sent``."""
    if wire is Wire.NOT_UTF8_MESSAGE_ID:
        return _RawText(sent.encode() + NOT_UTF8_ID_TAIL)
    return sent


def sent_id(read: str) -> str:
    """The attempt id a message id read back from the broker was sent as."""
    return read.removesuffix(READ_TAIL)


@contextmanager
def hostile_encoding() -> Iterator[None]:
    """While open, this process's pamqp encodes :class:`_Double` as a double and can recurse deep
    enough for a table nested :data:`DEEP` levels."""
    original = encode.encode_table_value

    def table_value(value: Any) -> bytes:
        if isinstance(value, _Double):
            return b"d" + struct.pack(">d", float(value))
        return original(value)

    encode.encode_table_value = table_value
    limit = sys.getrecursionlimit()
    sys.setrecursionlimit(max(limit, 20 * DEEP))
    try:
        with forged_tables():  # header tables written by hand, as they are
            yield
    finally:
        encode.encode_table_value = original
        sys.setrecursionlimit(limit)
