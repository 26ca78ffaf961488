"""AMQP field tables and arrays, read in one pass over one buffer, within limits, never raising.

Internal. pamqp's decoder hands every value the rest of the buffer as a new slice, so a table
costs its entries times its bytes: 60,000 entries in 120 KB took 170 ms, for every message that
carried them, on the reader that every other delivery waits behind. It also keeps the last of two
equal keys, so 60,000 entries sharing one key decoded to a one-key dict that passed any limit
measured on the decoded headers.

:class:`TableDecoder` reads by offset in the one buffer it is given (bytes or a memoryview of a
frame), each value bounded by the table it is in, and refuses before decoding anything beyond
:class:`TableLimits`:

- a table longer on the wire than ``max_bytes``: not decoded at all;
- more than ``max_entries`` entries, counted over the table and every table and array in it as
  they are read: the reading stops at the first one over, so a refused table costs at most that
  many entries' work;
- a table or array nested deeper than ``max_depth``: that value alone is not decoded;
- a key twice in one table: decoders disagree on which one wins (pamqp the last, RabbitMQ the
  first), so such a table has no one meaning; it is unreadable.

What it refuses or cannot read becomes a stand-in string (:class:`UnreadableHeader`,
:class:`HeaderTooDeep`, :class:`HeadersTooLarge`), never an exception: a whole table stands in as
``{UNREADABLE_KEY: ...}``, a nested one as the string in its place. The envelope parser makes any
of them poison. What it decodes is what pamqp decodes (tests/unit/test_field_table.py holds the
two together on valid tables), made fit to publish again as :mod:`consumer.amqp.wire` describes.
"""

from __future__ import annotations

import datetime
import math
import struct
from collections.abc import Callable
from dataclasses import dataclass
from decimal import Decimal
from typing import Any

__all__ = [
    "MAX_HEADER_DEPTH",
    "MAX_HEADER_ENTRIES",
    "UNREADABLE_KEY",
    "HeaderTooDeep",
    "HeadersTooLarge",
    "TableDecoder",
    "TableLimits",
    "UnreadableHeader",
]

MAX_HEADER_DEPTH = 16
"""Tables and arrays nested deeper than this in a header are not decoded. RabbitMQ's own
``x-death`` needs three levels."""

MAX_HEADER_ENTRIES = 1024
"""Entries a message's headers may hold, every table and array in them counted. RabbitMQ's
``x-death`` takes about eight per queue a message died in, the service's own headers ten."""

UNREADABLE_KEY = "unreadable-headers"
"""The one key of a table that stands in for a whole table refused or unreadable. Not under the
service's own ``consumer-`` prefix, which a producer's messages lose on arrival."""

Buffer = bytes | bytearray | memoryview


class UnreadableHeader(str):
    """Stands in for a header value that could not be decoded. A string, so that the headers
    still encode; a type of its own, so that the parser knows the message is poison."""

    __slots__ = ()


class HeaderTooDeep(UnreadableHeader):
    """Stands in for a table or array nested deeper than the limit."""

    __slots__ = ()


class HeadersTooLarge(UnreadableHeader):
    """Stands in for a table longer than the limit, or with more entries: never decoded."""

    __slots__ = ()


@dataclass(frozen=True, slots=True)
class TableLimits:
    """What :class:`TableDecoder` refuses before decoding (see the module docstring)."""

    max_bytes: int = 64 * 1024
    """A whole table's length on the wire (the headers property's: nested ones are inside it)."""
    max_entries: int = MAX_HEADER_ENTRIES
    """A whole table's entries: the pairs of every table in it and the items of every array."""
    max_depth: int = MAX_HEADER_DEPTH


class _Unreadable(Exception):
    """The table or array being read lies about a length or holds what cannot be read."""


class _TooMany(Exception):
    """More entries than the limit: the whole table is refused."""


_FLOAT32_MAX = 3.4028234663852886e38
_U32 = struct.Struct(">I").unpack_from


def _unpacker(fmt: str) -> Callable[[Buffer, int], Any]:
    unpack = struct.Struct(fmt).unpack_from

    def read(buffer: Buffer, offset: int) -> Any:
        return unpack(buffer, offset)[0]

    return read


def _boolean(buffer: Buffer, offset: int) -> bool:
    return bool(buffer[offset])


_read_double = _unpacker(">d")
_read_decimal = struct.Struct(">Bi").unpack_from
_read_timestamp = _unpacker(">Q")


def _double(buffer: Buffer, offset: int) -> float | str:
    number: float = _read_double(buffer, offset)
    if math.isfinite(number) and abs(number) > _FLOAT32_MAX:
        # pamqp encodes a float as single precision: a copy of the message could not carry it.
        return repr(number)
    return number


def _decimal(buffer: Buffer, offset: int) -> Decimal:
    places, raw = _read_decimal(buffer, offset)
    value: Decimal = Decimal(raw) * (Decimal(10) ** -places)  # pamqp's arithmetic and rounding
    return value


def _timestamp(buffer: Buffer, offset: int) -> datetime.datetime | UnreadableHeader:
    seconds: float = _read_timestamp(buffer, offset)
    if seconds > 0xFFFFFFFF:
        seconds /= 1000.0  # as pamqp reads it: past the year 2106, milliseconds
    try:
        return datetime.datetime.fromtimestamp(seconds, tz=datetime.UTC)
    except (ValueError, OverflowError, OSError):
        return UnreadableHeader("a timestamp out of range")


# Each fixed-size field type: its size and its reader (AMQP 0-9-1 as RabbitMQ's errata has it,
# with pamqp's signedness).
_FIXED: dict[int, tuple[int, Callable[[Buffer, int], Any]]] = {
    ord("t"): (1, _boolean),
    ord("b"): (1, _unpacker(">b")),
    ord("B"): (1, _unpacker(">B")),
    ord("s"): (2, _unpacker(">h")),
    ord("u"): (2, _unpacker(">H")),
    ord("I"): (4, _unpacker(">i")),
    ord("i"): (4, _unpacker(">I")),
    ord("l"): (8, _unpacker(">q")),
    ord("L"): (8, _unpacker(">q")),
    ord("f"): (4, _unpacker(">f")),
    ord("d"): (8, _double),
    ord("D"): (5, _decimal),
    ord("T"): (8, _timestamp),
}
_LONG_STRING, _BYTES, _TABLE, _ARRAY = ord("S"), ord("x"), ord("F"), ord("A")
_VOID = frozenset({ord("V"), 0})  # 0: not in the errata, but seen in the wild (pamqp)


def _why(error: Exception) -> str:
    return str(error) if isinstance(error, _Unreadable) else type(error).__name__


class _Reader:
    """One table's reading: the buffer and the entries it may still take."""

    __slots__ = ("buffer", "entries_left", "max_depth")

    def __init__(self, buffer: Buffer, limits: TableLimits) -> None:
        self.buffer = buffer
        self.entries_left = limits.max_entries
        self.max_depth = limits.max_depth

    def table(self, offset: int, end: int, depth: int) -> dict[str, Any]:
        buffer = self.buffer
        result: dict[str, Any] = {}
        while offset < end:
            key_end = offset + 1 + buffer[offset]
            if key_end >= end:  # a key, then at least a type byte
                raise _Unreadable("a key past the end of its table")
            key = str(buffer[offset + 1 : key_end], "utf-8")
            if key in result:
                raise _Unreadable(f"the key {key[:64]!r} twice in one table")
            self.entries_left -= 1
            if self.entries_left < 0:
                raise _TooMany
            offset, result[key] = self.value(key_end, end, depth)
        return result

    def array(self, offset: int, end: int, depth: int) -> list[Any]:
        result: list[Any] = []
        while offset < end:
            self.entries_left -= 1
            if self.entries_left < 0:
                raise _TooMany
            offset, item = self.value(offset, end, depth)
            result.append(item)
        return result

    def value(self, offset: int, end: int, depth: int) -> tuple[int, Any]:
        """The value at ``offset`` (its type byte), inside a table or array ending at ``end``."""
        buffer = self.buffer
        code = buffer[offset]
        offset += 1
        if code in (_LONG_STRING, _BYTES):
            start, stop = self._extent(offset, end)
            if code == _BYTES:
                return stop, bytearray(buffer[start:stop])
            # Not UTF-8: text with replacement characters (pamqp would give bytes).
            return stop, str(buffer[start:stop], "utf-8", "replace")
        fixed = _FIXED.get(code)
        if fixed is not None:
            size, read = fixed
            if offset + size > end:
                raise _Unreadable("a value past the end of its table")
            return offset + size, read(buffer, offset)
        if code in (_TABLE, _ARRAY):
            return self.nested(code, offset, end, depth + 1)
        if code in _VOID:
            return offset, None
        raise _Unreadable(f"a value of unknown type {code}")

    def nested(self, code: int, offset: int, end: int, depth: int) -> tuple[int, Any]:
        start, stop = self._extent(offset, end)
        if depth > self.max_depth:
            return stop, HeaderTooDeep(f"a header nested deeper than {self.max_depth} levels")
        try:
            if code == _TABLE:
                return stop, self.table(start, stop, depth)
            return stop, self.array(start, stop, depth)
        except _TooMany:
            raise
        except Exception as error:  # a nested table costs only itself
            return stop, UnreadableHeader(f"an unreadable header ({_why(error)})")

    def _extent(self, offset: int, end: int) -> tuple[int, int]:
        """Where the length-prefixed value at ``offset`` starts and stops."""
        start = offset + 4
        if start > end:
            raise _Unreadable("a length past the end of its table")
        stop = start + _U32(self.buffer, offset)[0]
        if stop > end:
            raise _Unreadable("a value longer than its table")
        return start, stop


class TableDecoder:
    """Decodes field tables and arrays with pamqp's signature, ``(buffer) -> (consumed, value)``,
    the buffer starting at the table's length; within ``limits``, never raising (see the module
    docstring)."""

    __slots__ = ("limits",)

    def __init__(self, limits: TableLimits) -> None:
        self.limits = limits

    def table(self, value: Buffer) -> tuple[int, dict[str, Any]]:
        """A whole table: its entries, or ``{UNREADABLE_KEY: stand-in}``."""
        limits = self.limits
        available = len(value)
        if available < 4:
            return available, _stand_in(UnreadableHeader("unreadable headers (cut short)"))
        length = _U32(value, 0)[0]
        stop = 4 + length
        if stop > available:
            # Its length lies: step over what there is.
            detail = "unreadable headers (longer than their frame)"
            return available, _stand_in(UnreadableHeader(detail))
        if length > limits.max_bytes:
            detail = f"headers of {length} bytes, over the limit of {limits.max_bytes}"
            return stop, _stand_in(HeadersTooLarge(detail))
        try:
            return stop, _Reader(value, limits).table(4, stop, 0)
        except _TooMany:
            detail = f"headers of more than {limits.max_entries} entries"
            return stop, _stand_in(HeadersTooLarge(detail))
        except Exception as error:  # whatever the bytes, never the reader task's end
            return stop, _stand_in(UnreadableHeader(f"unreadable headers ({_why(error)})"))

    def array(self, value: Buffer) -> tuple[int, Any]:
        """A whole array (a method's argument): its items, or an :class:`UnreadableHeader`."""
        available = len(value)
        if available < 4:
            return available, UnreadableHeader("an unreadable array (cut short)")
        stop = 4 + _U32(value, 0)[0]
        if stop > available:
            return available, UnreadableHeader("an unreadable array (longer than its frame)")
        try:
            return stop, _Reader(value, self.limits).array(4, stop, 0)
        except _TooMany:
            return stop, HeadersTooLarge(f"an array of more than {self.limits.max_entries} items")
        except Exception as error:
            return stop, UnreadableHeader(f"an unreadable array ({_why(error)})")


def _stand_in(detail: UnreadableHeader) -> dict[str, Any]:
    return {UNREADABLE_KEY: detail}
