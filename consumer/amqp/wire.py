"""Decoding what arrives on the wire so that no message can break the connection it came on.

aiormq decodes every frame with pamqp inside its reader task, and an exception there closes the
connection: every delivery it held comes back with its delivery count raised, and the message that
did it comes back first, again and again, until the delivery limit dead-letters it and its innocent
neighbours alike. A producer can send such a message on purpose or by accident: a header table
nested 3,000 deep (``RecursionError``), a short-string property that is not UTF-8
(``UnicodeDecodeError``), a timestamp past the year 9999 (``OverflowError``), a table whose lengths
lie. :func:`install` makes pamqp's decoders total: a value that cannot be decoded, or a table nested
deeper than :data:`MAX_HEADER_DEPTH`, becomes an :class:`UnreadableHeader`, which the envelope
parser makes poison (``headers_too_deep``, ``headers_unreadable``): the message costs only itself.

Decoded values are also made fit to publish again, since a failed event's copy carries the
original's headers to the retry ladder or the dead-letter exchange: a long string that is not UTF-8
becomes text with replacement characters, and a double too large for the single-precision float
pamqp encodes floats as becomes its text.
"""

from __future__ import annotations

import datetime
import math
import struct
from collections.abc import Callable
from typing import Any

from pamqp import decode

__all__ = ["MAX_HEADER_DEPTH", "HeaderTooDeep", "UnreadableHeader", "install"]

MAX_HEADER_DEPTH = 16
"""Tables and arrays nested deeper than this in a header are not decoded. RabbitMQ's own
``x-death`` needs three levels."""

_FLOAT32_MAX = 3.4028234663852886e38

Decoder = Callable[[bytes], tuple[int, Any]]


class UnreadableHeader(str):
    """Stands in for a header value that could not be decoded. A string, so that the headers
    still encode; a type of its own, so that the parser knows the message is poison."""

    __slots__ = ()


class HeaderTooDeep(UnreadableHeader):
    """Stands in for a table or array nested deeper than :data:`MAX_HEADER_DEPTH`."""

    __slots__ = ()


class _Depth:
    current = 0


def _skip(value: bytes) -> int:
    """The bytes a length-prefixed table or array takes, to step over it without decoding."""
    if len(value) < 4:
        return len(value)
    length: int = struct.unpack_from(">I", value)[0]
    return min(4 + length, len(value))


def _nested(original: Decoder) -> Decoder:
    def bounded(value: bytes) -> tuple[int, Any]:
        if _Depth.current >= MAX_HEADER_DEPTH:
            detail = f"a header nested deeper than {MAX_HEADER_DEPTH} levels"
            return _skip(value), HeaderTooDeep(detail)
        _Depth.current += 1
        try:
            return original(value)
        except Exception as error:  # whatever the bytes, never the reader task's end
            return _skip(value), UnreadableHeader(f"an unreadable header ({type(error).__name__})")
        finally:
            _Depth.current -= 1

    bounded.__wrapped__ = original  # type: ignore[attr-defined]
    return bounded


def _headers_table(original: Decoder) -> Decoder:
    def total(value: bytes) -> tuple[int, Any]:
        _Depth.current = 0
        try:
            return original(value)
        except Exception as error:
            detail = f"unreadable headers ({type(error).__name__})"
            # Not under the service's own consumer- prefix: a producer's are dropped on arrival.
            return _skip(value), {"unreadable-headers": UnreadableHeader(detail)}

    total.__wrapped__ = original  # type: ignore[attr-defined]
    return total


def _short_str(value: bytes) -> tuple[int, str]:
    if not value:
        raise ValueError("Could not unpack short string value")
    length = value[0]
    text = value[1 : length + 1].decode("utf-8", errors="replace")
    if len(text) * 3 > 255 and len(encoded := text.encode("utf-8")) > 255:
        # Each byte that is not UTF-8 became three: keep what a short string can carry again
        # (a retry or dead-letter copy republishes the message_id, correlation_id, ...).
        text = encoded[:255].decode("utf-8", errors="ignore")
    return length + 1, text


def _long_str(original: Decoder) -> Decoder:
    def as_text(value: bytes) -> tuple[int, Any]:
        consumed, decoded = original(value)
        if isinstance(decoded, bytes):
            decoded = decoded.decode("utf-8", errors="replace")
        return consumed, decoded

    as_text.__wrapped__ = original  # type: ignore[attr-defined]
    return as_text


def _timestamp(original: Decoder) -> Decoder:
    def in_range(value: bytes) -> tuple[int, Any]:
        try:
            return original(value)
        except (ValueError, OverflowError, OSError):
            return 8, UnreadableHeader("a timestamp out of range")

    in_range.__wrapped__ = original  # type: ignore[attr-defined]
    return in_range


def _property_timestamp(original: Decoder) -> Decoder:
    def in_range(value: bytes) -> tuple[int, datetime.datetime | None]:
        try:
            return original(value)
        except (ValueError, OverflowError, OSError):
            return 8, None  # the message's timestamp property: informational, dropped

    in_range.__wrapped__ = original  # type: ignore[attr-defined]
    return in_range


def _double(original: Decoder) -> Decoder:
    def publishable(value: bytes) -> tuple[int, Any]:
        consumed, number = original(value)
        if isinstance(number, float) and math.isfinite(number) and abs(number) > _FLOAT32_MAX:
            return consumed, repr(number)
        return consumed, number

    publishable.__wrapped__ = original  # type: ignore[attr-defined]
    return publishable


def install() -> None:
    """Make pamqp's decoders total, once per process (see the module docstring)."""
    if getattr(decode.METHODS["table"], "__wrapped__", None) is not None:
        return
    table, array = decode.TABLE_MAPPING[b"F"], decode.TABLE_MAPPING[b"A"]
    decode.TABLE_MAPPING[b"F"] = _nested(table)
    decode.TABLE_MAPPING[b"A"] = _nested(array)
    decode.METHODS["table"] = _headers_table(decode.METHODS["table"])
    decode.METHODS["array"] = _nested(decode.METHODS["array"])
    decode.METHODS["shortstr"] = _short_str
    long_str = _long_str(decode.TABLE_MAPPING[b"S"])
    decode.TABLE_MAPPING[b"S"] = long_str
    decode.METHODS["longstr"] = long_str
    decode.TABLE_MAPPING[b"T"] = _timestamp(decode.TABLE_MAPPING[b"T"])
    decode.METHODS["timestamp"] = _property_timestamp(decode.METHODS["timestamp"])
    decode.TABLE_MAPPING[b"d"] = _double(decode.TABLE_MAPPING[b"d"])
