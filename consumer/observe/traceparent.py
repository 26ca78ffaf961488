"""W3C trace context in message headers: ``traceparent`` (and ``tracestate``) read and written.

Pure, and free of OpenTelemetry (the core runs without the ``otel`` extra). A header is whatever a
producer wrote, so reading is total: a value that is not a valid trace context (garbage, too long,
version ``ff``, an all-zero id, a version-00 value with extra fields) is ignored, as the W3C
recommendation says (the event starts a trace of its own), never a failure.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

__all__ = [
    "MAX_TRACESTATE",
    "TRACEPARENT",
    "TRACESTATE",
    "TraceParent",
    "format_traceparent",
    "read_traceparent",
    "read_tracestate",
]

TRACEPARENT = "traceparent"
TRACESTATE = "tracestate"
MAX_TRACESTATE = 512
"""Longer ``tracestate`` values are dropped: the recommendation asks vendors to keep them under
512 characters, and a producer's must not grow every retry copy."""

# A future version may append fields; nothing legitimate comes near this.
_MAX_TRACEPARENT = 256
_HEX = frozenset("0123456789abcdef")
_VERSION_00_LENGTH = 55
# A tracestate list member (W3C): a key (or tenant@system), "=", a value of printable ASCII
# without "," and "=" that does not end in a space.
_MEMBER = re.compile(
    r"([a-z][a-z0-9_\-*/]{0,255}|[a-z0-9][a-z0-9_\-*/]{0,240}@[a-z][a-z0-9_\-*/]{0,13})"
    r"=[\x20-\x2b\x2d-\x3c\x3e-\x7e]{0,255}[\x21-\x2b\x2d-\x3c\x3e-\x7e]"
)
_MAX_MEMBERS = 32


@dataclass(frozen=True, slots=True)
class TraceParent:
    """A valid parent: the trace and span ids as integers, and the trace flags."""

    trace_id: int
    span_id: int
    flags: int

    @property
    def sampled(self) -> bool:
        return bool(self.flags & 0x01)


def _hex(text: str, length: int) -> int | None:
    if len(text) != length or not set(text) <= _HEX:
        return None
    return int(text, 16)


def _text(value: object, limit: int) -> str | None:
    if isinstance(value, bytes | bytearray):
        if len(value) > limit:
            return None
        value = bytes(value).decode("ascii", errors="replace")
    if not isinstance(value, str) or len(value) > limit:
        return None
    return value.strip(" \t")


def read_traceparent(headers: Mapping[str, Any] | None) -> TraceParent | None:
    """The ``traceparent`` header of ``headers`` if it is a valid one, else None."""
    if not headers:
        return None
    value = _text(headers.get(TRACEPARENT), _MAX_TRACEPARENT)
    if value is None:
        return None
    fields = value.split("-")
    if len(fields) < 4:
        return None
    version = _hex(fields[0], 2)
    if version is None or version == 0xFF:
        return None
    if version == 0 and (len(fields) != 4 or len(value) != _VERSION_00_LENGTH):
        return None
    trace_id = _hex(fields[1], 32)
    span_id = _hex(fields[2], 16)
    flags = _hex(fields[3], 2)
    if not trace_id or not span_id or flags is None:  # all-zero ids are invalid too
        return None
    return TraceParent(trace_id, span_id, flags)


def read_tracestate(headers: Mapping[str, Any] | None) -> list[str] | None:
    """The members of the ``tracestate`` header, if it is valid and short enough to carry on;
    None otherwise (an invalid list is dropped whole, as the recommendation says)."""
    if not headers:
        return None
    value = _text(headers.get(TRACESTATE), MAX_TRACESTATE)
    if not value:
        return None
    members = [member.strip(" \t") for member in value.split(",")]
    members = [member for member in members if member]
    if not members or len(members) > _MAX_MEMBERS:
        return None
    keys = set()
    for member in members:
        if _MEMBER.fullmatch(member) is None:
            return None
        keys.add(member.split("=", 1)[0])
    return members if len(keys) == len(members) else None


def format_traceparent(trace_id: int, span_id: int, flags: int) -> str:
    """A version-00 ``traceparent`` value."""
    return f"00-{trace_id:032x}-{span_id:016x}-{flags & 0xFF:02x}"
