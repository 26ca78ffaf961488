"""What a dead letter says about itself, and which ones an operation selects.

Pure: no broker here. :mod:`consumer.cli.dlq.stream` reads the queue, :mod:`consumer.cli.dlq.replay`
sends letters back.

Whose word a letter carries (:func:`dead_lettered_by_service`). A letter with no ``x-death``
header, its headers read whole, was published by the service itself: its ``consumer-*`` headers
are the service's (a producer's are dropped on arrival,
:func:`consumer.amqp.headers.trusted_headers`, and every copy the service publishes drops all
``x-*`` headers, :func:`consumer.amqp.headers.without_broker_headers`). Every other letter was
dead-lettered by the broker (a delivery limit, a nack), which keeps every header the message had, a
producer's ``consumer-*`` ones included, and always adds ``x-death`` (it replaces one that is not an
array: measured on RabbitMQ 3.10.8). So its ``consumer-*`` headers are unverified, and its reason,
time and routing key come from the broker: the reason from the newest ``x-death`` entry (for a nack,
from parsing the body again), the time from that entry, the routing key from the letter itself
(the broker dead-letters a message with its own). A producer that sets ``x-death`` itself only
makes its letter one of these: trusted less, never more.

What a producer can still write into a broker's letter (measured on 3.10.8): when its message
already carries an ``x-death`` entry for the same queue and reason, RabbitMQ moves that entry to
the front and counts it up, keeping its ``time``, ``exchange`` and ``routing-keys``: so a broker
letter's time (``--since``) and original exchange are the broker's word only as far as the
producer did not forge such an entry. Its reason and the routing key are always the broker's.
This holds as long as only the service can publish to ``<name>.dlx`` and to the default exchange
(which routes to ``<name>.dead`` by name).
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, NamedTuple, Protocol

from consumer.amqp import headers as h
from consumer.amqp.wire import UnreadableHeader
from consumer.error_text import error_name
from consumer.errors import Poison, PoisonReason
from consumer.pipeline.envelope_parser import EnvelopeParser, check_content_type, check_routing_key
from consumer.registry import HandlerRegistry

__all__ = [
    "EXPIRED",
    "REFUSED_EXPIRED",
    "REFUSED_ROUTING_KEY",
    "DeadMessage",
    "Readable",
    "Selection",
    "counts",
    "dead_lettered_by_service",
    "event_id_from",
    "read_dead_letter",
    "renewed",
]

EXPIRED = "expired"
REFUSED_EXPIRED = (
    "expired: its occurred_at is older than the receipts kept (CONSUMER_RECEIPT_RETENTION), so "
    "the service would refuse it again, and no receipt can say whether it was applied before; "
    "--force replays it as a new event (occurred_at set to now, the old one kept in the "
    f"{h.ORIGINAL_OCCURRED_AT} header): applied even if a copy was applied before"
)

REFUSED_ROUTING_KEY = (
    "routing_key_mismatch: its producer published it under another type's routing key, which "
    "the broker may have allowed it where this type's would not be; a replay goes out under the "
    "type's own (as the bootstrap user), so --force replays it only if you know the producer may "
    "publish this type"
)

# What the broker's own dead-lettering reasons mean here. Its "expired" is a message's TTL (a
# producer can set one), never the service's `expired`: named apart, so that neither `--reason`
# nor a reader takes one for the other.
_BROKER_REASONS = {"delivery_limit": "delivery_limit", "expired": "ttl_expired", "maxlen": "maxlen"}
_X_DEATH = "x-death"
_REJECTED = ("rejected", "?")
"""A nack's reason, or none readable (headers refused on the wire, consumer.amqp.wire): the poison
the letter is judged again as says why it was rejected."""


@dataclass(frozen=True, slots=True)
class DeadMessage:
    """One message in the dead-letter queue, as an operator sees it."""

    position: int
    id: str
    event_id: str | None
    message_id: str | None
    type: str | None
    reason: str
    error_class: str | None
    error_message: str | None
    attempts: int | None
    """Retries published before it died; None where the broker dead-lettered it (unverified)."""
    dead_lettered_at: datetime | None
    original_exchange: str | None
    original_routing_key: str
    deliveries: int
    headers: dict[str, Any]
    body: bytes
    poison_detail: str | None
    by_service: bool = True
    """The service published it (no ``x-death``): its ``consumer-*`` headers are the service's.
    False: the broker dead-lettered it, and they are unverified (the module docstring)."""

    @property
    def expired(self) -> bool:
        """The service refused it as too old to deduplicate (not a broker's TTL expiry, nor a
        producer's forged reason)."""
        return self.by_service and h.text(self.headers.get(h.REASON)) == EXPIRED

    @property
    def unverified(self) -> dict[str, Any]:
        """The ``consumer-*`` headers of a letter the broker dead-lettered: a producer's, or the
        retry ladder's; nothing tells which."""
        if self.by_service:
            return {}
        return {k: v for k, v in self.headers.items() if k.startswith(h.OWN_PREFIX)}

    def refusal(self, *, force: bool) -> str | None:
        """Why a replay keeps it unless ``force``d; None when it goes."""
        if force:
            return None
        if self.expired:
            return REFUSED_EXPIRED
        if self.reason == PoisonReason.ROUTING_KEY_MISMATCH.value:
            return REFUSED_ROUTING_KEY
        return None

    def summary(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": self.type,
            "reason": self.reason,
            "dead_lettered_by": "service" if self.by_service else "broker",
            "attempts": self.attempts,
            "dead_lettered_at": self.dead_lettered_at.isoformat()
            if self.dead_lettered_at
            else None,
            "error_class": self.error_class,
            "error": self.error_message or self.poison_detail,
        }


def dead_lettered_by_service(headers: Mapping[str, Any]) -> bool:
    """Whether the service published this letter itself, so that its ``consumer-*`` headers
    are its own: its headers were read whole (no stand-in for what could not be decoded, which
    may have hidden an ``x-death``) and carry no ``x-death`` (the module docstring)."""
    if _X_DEATH in headers:
        return False
    return not any(isinstance(value, UnreadableHeader) for value in headers.values())


def _newest_death(headers: dict[str, Any]) -> dict[str, Any] | None:
    """The broker's newest ``x-death`` entry: why and when it is here now (RabbitMQ puts the
    entry of the death that brought it here first)."""
    deaths = headers.get(_X_DEATH)
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        return deaths[0]
    return None


def _x_death_time(death: dict[str, Any]) -> datetime | None:
    stamp = death.get("time")
    if isinstance(stamp, datetime):
        return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)
    return None


def _parse_time(value: object) -> datetime | None:
    raw = h.text(value)
    if raw is None:
        return None
    try:
        stamp = datetime.fromisoformat(raw)
    except ValueError:
        return None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def event_id_from(body: bytes) -> str | None:
    try:
        decoded = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(decoded, dict) and isinstance(decoded.get("event_id"), str):
        return str(decoded["event_id"])[:64]
    return None


class Readable(Protocol):
    """What a dead letter is read from: aio-pika's incoming message, or the scan's lighter
    :class:`consumer.cli.dlq.stream.Delivered`."""

    @property
    def body(self) -> bytes: ...
    @property
    def headers(self) -> Mapping[str, Any] | None: ...
    @property
    def content_type(self) -> str | None: ...
    @property
    def content_encoding(self) -> str | None: ...
    @property
    def message_id(self) -> str | None: ...
    @property
    def routing_key(self) -> str | None: ...


def read_dead_letter(
    message: Readable,
    position: int,
    *,
    registry: HandlerRegistry,
    parser: EnvelopeParser,
    validate: bool = True,
) -> DeadMessage:
    """What a dead letter says about itself; poison is parsed again to say why it failed.

    ``validate=False`` (a replay, which sends the body on as it is): the payload is checked
    against its handler's model only when the letter's reason depends on it (dead-lettered by
    the broker as rejected, with no reason header of ours); ``poison_detail`` is then ``None``
    for a letter whose payload was not checked. The type and event id are read either way.
    """
    headers = dict(message.headers or {})
    body = message.body
    by_service = dead_lettered_by_service(headers)
    # The newest x-death entry says why it is here now; the first death may be a retry rung's
    # expiry long before.
    death = {} if by_service else _newest_death(headers) or {}
    broker_reason = "" if by_service else h.text(death.get("reason")) or "?"
    event_type: str | None = None
    event_id: str | None = None
    poison: Poison | None = None
    try:
        check_content_type(message.content_type, message.content_encoding)
        parser.check_headers(headers)
        raw = parser.parse(body)
        event_id, event_type = str(raw.event_id), raw.type
        if broker_reason in _REJECTED:
            # As the service judged it: nacked poison keeps the routing key it was published with.
            check_routing_key(message.routing_key or "", raw.type)
        if validate or broker_reason in _REJECTED:
            registry.resolve(raw)
    except Poison as error:
        poison = error
        event_id = event_id or event_id_from(body)
    except Exception as error:  # a payload validator's own exception: as the service judged it
        poison = Poison(
            PoisonReason.INVALID_PAYLOAD, f"{error_name(error)}: {error}", error_name(error)
        )
        event_id = event_id or event_id_from(body)
    word = (
        _service_word(headers, message.routing_key)
        if by_service
        else _broker_word(death, broker_reason, poison, message.routing_key)
    )
    ident = event_id or message.message_id or "sha1:" + hashlib.sha1(body).hexdigest()[:12]
    return DeadMessage(
        position=position,
        id=ident,
        event_id=event_id,
        message_id=message.message_id,
        type=event_type,
        reason=word.reason,
        error_class=word.error_class,
        error_message=word.error_message,
        attempts=word.attempts,
        dead_lettered_at=word.dead_lettered_at,
        original_exchange=word.original_exchange,
        original_routing_key=word.original_routing_key,
        deliveries=h.attempts_so_far({h.ATTEMPT: headers.get("x-delivery-count")}),
        headers=headers,
        body=body,
        poison_detail=poison.detail if poison is not None else None,
        by_service=by_service,
    )


class _Word(NamedTuple):
    """What a letter's dead-lettering says of it, from whoever dead-lettered it."""

    reason: str
    dead_lettered_at: datetime | None
    original_exchange: str | None
    original_routing_key: str
    attempts: int | None
    error_class: str | None = None
    error_message: str | None = None


def _service_word(headers: dict[str, Any], routing_key: str | None) -> _Word:
    """A letter the service published: its own headers say it all."""
    return _Word(
        reason=h.text(headers.get(h.REASON)) or "?",
        dead_lettered_at=_parse_time(headers.get(h.DEAD_LETTERED_AT)),
        original_exchange=h.text(headers.get(h.ORIGINAL_EXCHANGE)),
        original_routing_key=h.text(headers.get(h.ORIGINAL_ROUTING_KEY)) or routing_key or "",
        attempts=h.attempts_so_far(headers),
        error_class=h.text(headers.get(h.ERROR_CLASS)),
        error_message=h.text(headers.get(h.ERROR_MESSAGE)),
    )


def _broker_word(
    death: dict[str, Any], reason: str, poison: Poison | None, routing_key: str | None
) -> _Word:
    """A letter the broker dead-lettered: its newest ``x-death`` entry and the letter itself,
    never its ``consumer-*`` headers. A nack's reason is what parsing the letter again finds."""
    if reason in _REJECTED:
        reason = poison.reason.value if poison is not None else reason
    else:
        reason = _BROKER_REASONS.get(reason, reason)
    return _Word(
        reason=reason,
        dead_lettered_at=_x_death_time(death),
        original_exchange=h.text(death.get("exchange")),
        original_routing_key=routing_key or "",
        attempts=None,
    )


@dataclass(frozen=True, slots=True)
class Selection:
    """Which dead letters an operation applies to; every given criterion must hold."""

    ids: frozenset[str] = frozenset()
    reason: str | None = None
    type: str | None = None
    since: datetime | None = None
    everything: bool = False

    @property
    def empty(self) -> bool:
        return not (self.ids or self.reason or self.type or self.since or self.everything)

    def matches(self, letter: DeadMessage) -> bool:
        if self.ids and not self.ids & {letter.id, letter.event_id, letter.message_id}:
            return False
        if self.reason is not None and letter.reason != self.reason:
            return False
        if self.type is not None and letter.type != self.type:
            return False
        return not (
            self.since is not None
            and (letter.dead_lettered_at is None or letter.dead_lettered_at < self.since)
        )


def counts(letters: Iterable[DeadMessage]) -> tuple[Counter[str], Counter[str]]:
    """Dead letters counted by reason and by type (``?`` for poison with no readable type)."""
    by_reason: Counter[str] = Counter()
    by_type: Counter[str] = Counter()
    for letter in letters:
        by_reason[letter.reason] += 1
        by_type[letter.type or "?"] += 1
    return by_reason, by_type


def renewed(body: bytes, now: datetime) -> tuple[bytes, str]:
    """An expired event's body with ``occurred_at`` set to ``now``, and the old value: to the
    receipts a new event, since (event_id, occurred_at) is what they deduplicate on."""
    envelope = json.loads(body)
    before = str(envelope["occurred_at"])
    envelope["occurred_at"] = now.isoformat()
    return json.dumps(envelope, ensure_ascii=False, separators=(",", ":")).encode(), before
