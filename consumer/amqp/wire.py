"""Decoding what arrives on the wire so that no message can break the connection it came on, or
cost more than a bounded amount of work.

aiormq decodes every frame with pamqp inside its reader task, and an exception there closes the
connection: every delivery it held comes back with its delivery count raised, and the message that
did it comes back first, again and again, until the delivery limit dead-letters it and its innocent
neighbours alike. A producer can send such a message on purpose or by accident: a header table
nested 3,000 deep (``RecursionError``), a short-string property that is not UTF-8
(``UnicodeDecodeError``), a timestamp past the year 9999 (``OverflowError``), a table whose lengths
lie; or one that costs the reader seconds, every other delivery waiting: 60,000 header entries
(pamqp's table decoder costs entries times bytes). :func:`install` puts the service's own field
table decoder (:mod:`consumer.amqp.field_table`: offset-based, total, within :class:`TableLimits`)
in pamqp's place and makes pamqp's other decoders total: a value that cannot be decoded becomes an
:class:`UnreadableHeader`, a table nested deeper than the limit a :class:`HeaderTooDeep`, headers
longer or with more entries than the limits a :class:`HeadersTooLarge` (not decoded at all); the
envelope parser makes each poison (``headers_unreadable``, ``headers_too_deep``,
``headers_too_large``): the message costs only itself.

Decoded values are also made fit to publish again, since a failed event's copy carries the
original's headers to the retry ladder or the dead-letter exchange: a long string that is not UTF-8
becomes text with replacement characters, and a double too large for the single-precision float
pamqp encodes floats as becomes its text.

pamqp's decoders are process-wide, so are these: the limits of the last :func:`install` hold for
every connection of the process (one service per process, as deployed). The broker's own tables
(``Connection.Start``'s server properties: about 500 bytes, 20 entries) pass the smallest limits
the settings allow. :func:`self_test` checks at start-up that what pamqp and the fast path
(:mod:`consumer.amqp.frames`) decode through refuses what it must: a newer pamqp that reads tables
another way stops the service with one line instead of letting the limits go unenforced.
"""

from __future__ import annotations

import datetime
import struct
from collections.abc import Callable
from importlib import metadata
from typing import Any

from pamqp import commands, decode
from pamqp import frame as pamqp_frame
from pamqp.header import ContentHeader

from consumer.amqp import frames
from consumer.amqp.field_table import (
    MAX_HEADER_DEPTH,
    UNREADABLE_KEY,
    HeadersTooLarge,
    HeaderTooDeep,
    TableDecoder,
    TableLimits,
    UnreadableHeader,
)
from consumer.errors import IncompatibleLibrary

__all__ = [
    "MAX_HEADER_DEPTH",
    "UNREADABLE_KEY",
    "HeaderTooDeep",
    "HeadersTooLarge",
    "TableLimits",
    "UnreadableHeader",
    "install",
    "self_test",
]

Decoder = Callable[[bytes], tuple[int, Any]]


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


def _property_timestamp(original: Decoder) -> Decoder:
    def in_range(value: bytes) -> tuple[int, datetime.datetime | None]:
        try:
            return original(value)
        except (ValueError, OverflowError, OSError):
            return 8, None  # the message's timestamp property: informational, dropped

    in_range.__wrapped__ = original  # type: ignore[attr-defined]
    return in_range


def _installed_decoder() -> TableDecoder | None:
    return getattr(decode.METHODS["table"], "__self__", None)


def install(limits: TableLimits | None = None) -> None:
    """Put the service's table decoder, with ``limits``, in pamqp's place and make its other
    decoders total (see the module docstring). pamqp reads every table and array of every frame
    through ``decode.METHODS``; its own ``field_table``, ``field_array`` and ``embedded_value``
    are no longer called."""
    limits = limits or TableLimits()
    installed = _installed_decoder()
    if isinstance(installed, TableDecoder) and installed.limits == limits:
        return
    decoder = TableDecoder(limits)
    decode.METHODS["table"] = decoder.table
    decode.METHODS["array"] = decoder.array
    decode.METHODS["shortstr"] = _short_str
    for name, wrap in (("longstr", _long_str), ("timestamp", _property_timestamp)):
        if getattr(decode.METHODS[name], "__wrapped__", None) is None:
            decode.METHODS[name] = wrap(decode.METHODS[name])


# -- the start-up self-test ----------------------------------------------------------------------


def _short(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def _table(entries: bytes) -> bytes:
    return struct.pack(">I", len(entries)) + entries


def _nested(depth: int) -> bytes:
    table = _table(b"")
    for _ in range(depth):
        table = _table(_short(b"a") + b"F" + table)
    return table


Case = tuple[str, bytes, type[UnreadableHeader]]


def _cases(limits: TableLimits) -> list[Case]:
    entry = _short(b"a") + b"S"
    filler = max(0, limits.max_bytes + 1 - len(entry) - 4)
    deep = limits.max_depth + 1
    cases: list[Case] = [
        (f"a table nested {deep} deep", _nested(deep), HeaderTooDeep),
        (
            f"a table of {limits.max_bytes + 1} bytes",
            _table(entry + struct.pack(">I", filler) + b"x" * filler),
            HeadersTooLarge,
        ),
        ("a table with a key twice", _table((_short(b"k") + b"V") * 2), UnreadableHeader),
    ]
    voids = limits.max_entries + 1
    if 4 + 7 + voids <= limits.max_bytes:  # else the byte limit refuses it first
        many = _table(_short(b"a") + b"A" + struct.pack(">I", voids) + b"V" * voids)
        cases.append((f"a table of {voids} entries", many, HeadersTooLarge))
    return cases


def _refused(headers: Any, expected: type[UnreadableHeader]) -> bool:
    """Whether ``expected`` stands somewhere in ``headers`` (a stand-in at any depth)."""
    stack = [headers]
    while stack:
        item = stack.pop()
        if isinstance(item, expected):
            return True
        if isinstance(item, dict):
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def _header_frame(table: bytes) -> bytes:
    flags = commands.Basic.Properties.flags["headers"]
    payload = struct.pack(">HHQH", 60, 0, 0, flags) + table
    return struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce"


def _headers_of(frame: object) -> Any:
    if not isinstance(frame, ContentHeader):
        raise TypeError(f"{type(frame).__name__} instead of a content header")
    return frame.properties.headers


def self_test(limits: TableLimits) -> None:
    """Decode, through each way a frame's tables are read (pamqp's ``decode.by_type``, pamqp's
    frame decoder, the fast path :func:`consumer.amqp.frames.decode_frame`), a table past each of
    ``limits`` and one with a key twice; :class:`IncompatibleLibrary` naming the first that was
    not refused. Call it after :func:`install` with the same limits."""
    paths: list[tuple[str, Callable[[bytes], Any]]] = [
        ("pamqp's decode.by_type", lambda table: decode.by_type(table, "table")[1]),
        (
            "pamqp's frame decoder",
            lambda table: _headers_of(pamqp_frame.unmarshal(_header_frame(table))[2]),
        ),
        (
            "the fast path (consumer.amqp.frames)",
            lambda table: _headers_of(frames.decode_frame(_header_frame(table))),
        ),
    ]
    for case, table, expected in _cases(limits):
        for path, read in paths:
            try:
                headers = read(table)
            except Exception as error:  # any escape is a failure to report, not to crash on
                got = f"raised {type(error).__name__}"
            else:
                if _refused(headers, expected):
                    continue
                got = "decoded it"
            version = metadata.version("pamqp")
            raise IncompatibleLibrary(
                f"the AMQP header decoders do not hold the service's limits: {path} {got} "
                f"instead of refusing {case} ({expected.__name__}); pamqp {version} may "
                "decode tables another way than consumer.amqp.wire expects"
            )
