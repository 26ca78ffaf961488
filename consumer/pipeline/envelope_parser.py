"""The parser that turns a message body into an envelope, and the limits it holds bodies and
headers to.

The parser never raises anything but :class:`Poison`: for any bytes it returns an envelope or says
why the message can never be processed.
"""

from __future__ import annotations

import json
import math
import re
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, RootModel, ValidationError

from consumer.amqp.field_table import (
    MAX_HEADER_DEPTH,
    MAX_HEADER_ENTRIES,
    HeadersTooLarge,
    HeaderTooDeep,
    TableLimits,
    UnreadableHeader,
)
from consumer.envelope import Envelope, RawEnvelope
from consumer.errors import Poison, PoisonReason
from consumer.safe_text import describe_validation_error, one_line

__all__ = ["EnvelopeLimits", "EnvelopeParser", "check_content_type", "check_routing_key"]


class _LenientRawEnvelope(RawEnvelope):
    """The same envelope, ignoring unknown top-level fields (``CONSUMER_ALLOW_EXTRA_FIELDS``)."""

    model_config = ConfigDict(frozen=True, extra="ignore")


_JSON_CONTENT_TYPES = frozenset({"application/json", "text/json"})
_IDENTITY_ENCODINGS = frozenset({"", "identity", "utf-8", "utf8"})


def check_content_type(content_type: str | None, content_encoding: str | None) -> None:
    """Accept an absent or JSON content type and no content encoding; raise :class:`Poison` else."""
    if not content_encoding and (content_type is None or content_type in _JSON_CONTENT_TYPES):
        return  # what nearly every message says: nothing to take apart
    if content_type:
        media_type, _, params = content_type.partition(";")
        if media_type.strip().lower() not in _JSON_CONTENT_TYPES:
            raise Poison(PoisonReason.WRONG_CONTENT_TYPE, f"content type {content_type!r}")
        charset = params.strip().lower().removeprefix("charset=").strip('"')
        if params.strip() and charset not in ("utf-8", "utf8"):
            raise Poison(PoisonReason.WRONG_CONTENT_TYPE, f"content type {content_type!r}")
    if content_encoding and content_encoding.strip().lower() not in _IDENTITY_ENCODINGS:
        raise Poison(PoisonReason.WRONG_CONTENT_TYPE, f"content encoding {content_encoding!r}")


def check_routing_key(routing_key: str, event_type: str) -> None:
    """Poison unless the event's type is the routing key it was published with.

    RabbitMQ authorises a producer's publish by its routing key (topic permissions), never by the
    body: a producer allowed only ``notification.*`` could otherwise have an ``inventory.restock``
    applied. Every way a message comes back to the work queue keeps the routing key it was
    published with (a retry copy, a rung's dead-lettering, a migration's move) or sets the type
    (``dlq replay``)."""
    if event_type != routing_key:
        raise Poison(
            PoisonReason.ROUTING_KEY_MISMATCH,
            one_line(f"type {event_type!r} published with routing key {routing_key[:255]!r}"),
        )


@dataclass(frozen=True, slots=True)
class EnvelopeLimits:
    """What the parser accepts; anything beyond is poison."""

    max_bytes: int = 256 * 1024
    max_depth: int = 32
    max_containers: int = 10_000
    max_header_bytes: int = 64 * 1024
    max_header_entries: int = MAX_HEADER_ENTRIES
    """Entries in a message's headers, every nested table and array counted (not a setting: no
    producer needs more, and a byte limit alone lets 2-byte entries cost the most)."""
    max_future_skew: timedelta = timedelta(hours=24)
    allow_extra_fields: bool = False

    def header_tables(self) -> TableLimits:
        """The header limits as the wire decoder holds them: the headers' length and entries
        are refused on the wire, before anything is decoded (:mod:`consumer.amqp.field_table`)."""
        return TableLimits(
            max_bytes=self.max_header_bytes,
            max_entries=self.max_header_entries,
            max_depth=MAX_HEADER_DEPTH,
        )


class _DuplicateKey(ValueError):
    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Parsers disagree on which of two equal keys wins; a producer's validator and this service
    # could read different events from one body. Refuse the body instead.
    result = dict(pairs)
    if len(result) != len(pairs):
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _DuplicateKey(key)
            seen.add(key)
    return result


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def _finite(text: str) -> float:
    # Called for number literals with a fraction or an exponent only (integers never pay). A
    # literal past the double range (1e309) is infinity to float(): a value JSON has no way to
    # write, which a handler would meet (and fail on, or store) instead of the parser.
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"number {text[:40]} is out of range (not a finite double)")
    return value


# One decoder for every body: json.loads with these hooks builds a new one per call.
_DECODER = json.JSONDecoder(
    object_pairs_hook=_unique_keys, parse_constant=_no_constants, parse_float=_finite
)

_JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)


def _containers(body: bytes) -> int:
    """Objects and arrays in ``body``: its brackets outside strings."""
    bare = _JSON_STRING.sub(b"", body)
    return bare.count(b"{") + bare.count(b"[")


def _deeper_than(value: object, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[object] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


_STAND_IN_REASONS: dict[type[UnreadableHeader], PoisonReason] = {
    HeaderTooDeep: PoisonReason.HEADERS_TOO_DEEP,
    HeadersTooLarge: PoisonReason.HEADERS_TOO_LARGE,
}


def _header_size(value: object, budget: int) -> int:
    """Roughly the bytes ``value`` takes in an AMQP headers table, counting up to ``budget``;
    raises :class:`Poison` where the decoder left an unreadable value
    (:mod:`consumer.amqp.wire`)."""
    size = 0
    stack = [value]
    while stack and size <= budget:
        item = stack.pop()
        if isinstance(item, UnreadableHeader):
            reason = _STAND_IN_REASONS.get(type(item), PoisonReason.HEADERS_UNREADABLE)
            raise Poison(reason, str(item))
        if isinstance(item, str):
            # Bytes, not characters: each byte that was not UTF-8 decoded to a replacement
            # character of three (consumer.amqp.wire), and a copy of the message carries them all.
            size += (len(item) if item.isascii() else len(item.encode("utf-8", "replace"))) + 5
        elif isinstance(item, bytes | bytearray):
            size += len(item) + 5
        elif isinstance(item, dict):
            size += sum(len(key) + 1 for key in item)
            stack.extend(item.values())
        elif isinstance(item, list | tuple):
            stack.extend(item)
        else:
            size += 9
    return size


class EnvelopeParser:
    """Turns a message body into an envelope, or raises :class:`Poison` saying why it cannot.

    For any bytes it does one of the two and nothing else: UTF-8 is strict, JSON is standard
    (no NaN, no number past the double range, no duplicate keys), nesting is bounded, the
    envelope's schema is strict.
    """

    def __init__(self, limits: EnvelopeLimits) -> None:
        self.limits = limits
        self._max_skew_s = limits.max_future_skew.total_seconds()
        self._model: type[RawEnvelope] = (
            _LenientRawEnvelope if limits.allow_extra_fields else RawEnvelope
        )

    def check_headers(self, headers: Mapping[str, Any]) -> None:
        """Poison for headers over the size limit, or that could not be decoded."""
        limit = self.limits.max_header_bytes
        if headers and _header_size(headers, limit) > limit:
            raise Poison(PoisonReason.HEADERS_TOO_LARGE, f"headers over {limit} bytes")

    def parse(self, body: bytes, *, now: datetime | None = None) -> RawEnvelope:
        """The envelope in ``body``, its payload any JSON object; or :class:`Poison`."""
        return self.validate(self.decode(body), now=now)

    def decode(self, body: bytes) -> dict[str, Any]:
        """``body`` as a JSON object within the limits, not yet validated; or :class:`Poison`."""
        limits = self.limits
        if len(body) > limits.max_bytes:
            raise Poison(
                PoisonReason.BODY_TOO_LARGE, f"{len(body)} bytes, the limit is {limits.max_bytes}"
            )
        # A body is parsed into an object per container: bound them before building any, so one
        # body cannot cost a worker seconds and hundreds of megabytes (a megabyte of "[]").
        brackets = body.count(b"{") + body.count(b"[")
        if brackets > limits.max_containers and _containers(body) > limits.max_containers:
            raise Poison(
                PoisonReason.TOO_COMPLEX,
                f"more than {limits.max_containers} objects and arrays",
            )
        try:
            text = body.decode("utf-8")
        except UnicodeDecodeError as error:
            raise Poison(PoisonReason.NOT_UTF8, f"invalid UTF-8 at byte {error.start}") from None
        try:
            decoded = _DECODER.decode(text)
        except _DuplicateKey as duplicate:
            raise Poison(
                PoisonReason.DUPLICATE_KEY, one_line(f"key {duplicate.key[:100]!r} appears twice")
            ) from None
        except RecursionError:
            raise Poison(PoisonReason.TOO_DEEP, f"nested deeper than {limits.max_depth}") from None
        except ValueError as error:
            raise Poison(PoisonReason.NOT_JSON, one_line(str(error), 200)) from None
        if not isinstance(decoded, dict):
            raise Poison(PoisonReason.INVALID_ENVELOPE, "the body is not a JSON object")
        # Nesting needs a bracket per level: a body with few brackets needs no walk.
        if brackets > limits.max_depth and _deeper_than(decoded, limits.max_depth):
            raise Poison(PoisonReason.TOO_DEEP, f"nested deeper than {limits.max_depth}")
        return decoded

    def validate(self, decoded: dict[str, Any], *, now: datetime | None = None) -> RawEnvelope:
        """The envelope schema (any object as payload) and the clock skew; or :class:`Poison`."""
        try:
            envelope = self._model.model_validate(decoded)
        except ValidationError as error:
            raise Poison(PoisonReason.INVALID_ENVELOPE, describe_validation_error(error)) from None
        self.check_skew(envelope, now=now)
        return envelope

    def typed(self, payload: Any) -> type[Envelope[Any]] | None:
        """The envelope model whose payload is the model ``payload``, for validating an event in
        one pass; None where one pass would not judge as :meth:`validate` plus the payload model
        do (a payload type that is not a plain pydantic model need not be a JSON object)."""
        # A RootModel need not be an object, which the envelope's own schema requires.
        if not isinstance(payload, type) or not issubclass(payload, BaseModel):
            return None
        if issubclass(payload, RootModel):
            return None
        model: type[Envelope[Any]] = Envelope[payload]
        if self.limits.allow_extra_fields:
            lenient = ConfigDict(frozen=True, extra="ignore")
            model = type(f"Lenient{model.__name__}", (model,), {"model_config": lenient})
        return model

    def check_skew(self, envelope: Envelope[Any], *, now: datetime | None = None) -> None:
        now_ts = now.timestamp() if now is not None else time.time()
        self.check_skew_at(envelope, envelope.occurred_at.timestamp(), now_ts)

    def check_skew_at(self, envelope: Envelope[Any], occurred: float, now: float) -> None:
        """:meth:`check_skew` on POSIX timestamps already taken (cheaper than aware datetimes,
        once per message)."""
        if occurred - now > self._max_skew_s:
            ahead = envelope.occurred_at - datetime.fromtimestamp(now, UTC)
            raise Poison(
                PoisonReason.INVALID_ENVELOPE,
                f"occurred_at is {ahead} in the future (more than {self.limits.max_future_skew})",
            )
