"""What a dead letter says about itself, and which ones an operation selects.

Pure: no broker here. :mod:`consumer.dlq_stream` reads the queue, :mod:`consumer.dlq_replay` sends
letters back.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any, Protocol

from consumer import headers as h
from consumer.envelope_parser import EnvelopeParser, check_content_type, check_routing_key
from consumer.error_text import error_name
from consumer.errors import Poison, PoisonReason
from consumer.registry import HandlerRegistry

__all__ = [
    "EXPIRED",
    "REFUSED_EXPIRED",
    "REFUSED_ROUTING_KEY",
    "DeadMessage",
    "Readable",
    "Selection",
    "counts",
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

# What the broker's own dead-lettering reasons mean here.
_BROKER_REASONS = {"delivery_limit": "delivery_limit", "expired": "expired", "maxlen": "maxlen"}


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
    attempts: int
    dead_lettered_at: datetime | None
    original_exchange: str | None
    original_routing_key: str
    deliveries: int
    headers: dict[str, Any]
    body: bytes
    poison_detail: str | None

    @property
    def expired(self) -> bool:
        """The service refused it as too old to deduplicate (not a broker's TTL expiry)."""
        return h.text(self.headers.get(h.REASON)) == EXPIRED

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
            "attempts": self.attempts,
            "dead_lettered_at": self.dead_lettered_at.isoformat()
            if self.dead_lettered_at
            else None,
            "error_class": self.error_class,
            "error": self.error_message or self.poison_detail,
        }


def _newest_death(headers: dict[str, Any]) -> dict[str, Any] | None:
    """The broker's newest ``x-death`` entry: why and when it is here now."""
    deaths = headers.get("x-death")
    if isinstance(deaths, list) and deaths and isinstance(deaths[0], dict):
        return deaths[0]
    return None


def _x_death_time(headers: dict[str, Any]) -> datetime | None:
    stamp = (_newest_death(headers) or {}).get("time")
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
    :class:`consumer.dlq_stream.Delivered`."""

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
    reason = h.text(headers.get(h.REASON))
    # The newest x-death entry says why it is here now; the first death may be a retry rung's
    # expiry long before.
    broker_reason = (
        ""
        if reason is not None
        else h.text((_newest_death(headers) or {}).get("reason"))
        or h.text(headers.get("x-first-death-reason"))
        or "?"
    )
    event_type: str | None = None
    event_id: str | None = None
    poison: Poison | None = None
    try:
        check_content_type(message.content_type, message.content_encoding)
        parser.check_headers(headers)
        raw = parser.parse(body)
        event_id, event_type = str(raw.event_id), raw.type
        if broker_reason == "rejected":
            # As the service judged it: nacked poison keeps the routing key it was published with.
            check_routing_key(message.routing_key or "", raw.type)
        if validate or broker_reason == "rejected":
            registry.resolve(raw)
    except Poison as error:
        poison = error
        event_id = event_id or event_id_from(body)
    except Exception as error:  # a payload validator's own exception: as the service judged it
        poison = Poison(
            PoisonReason.INVALID_PAYLOAD, f"{error_name(error)}: {error}", error_name(error)
        )
        event_id = event_id or event_id_from(body)
    if reason is None:
        if broker_reason == "rejected":
            reason = poison.reason.value if poison is not None else "rejected"
        else:
            reason = _BROKER_REASONS.get(broker_reason, broker_reason)
    ident = event_id or message.message_id or "sha1:" + hashlib.sha1(body).hexdigest()[:12]
    return DeadMessage(
        position=position,
        id=ident,
        event_id=event_id,
        message_id=message.message_id,
        type=event_type,
        reason=reason,
        error_class=h.text(headers.get(h.ERROR_CLASS)),
        error_message=h.text(headers.get(h.ERROR_MESSAGE)),
        attempts=h.attempts_so_far(headers),
        dead_lettered_at=_parse_time(headers.get(h.DEAD_LETTERED_AT)) or _x_death_time(headers),
        original_exchange=h.text(headers.get(h.ORIGINAL_EXCHANGE))
        or h.text(headers.get("x-first-death-exchange")),
        original_routing_key=h.text(headers.get(h.ORIGINAL_ROUTING_KEY))
        or message.routing_key
        or "",
        deliveries=h.attempts_so_far({h.ATTEMPT: headers.get("x-delivery-count")}),
        headers=headers,
        body=body,
        poison_detail=poison.detail if poison is not None else None,
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
