"""Reading, replaying and purging the dead-letter queue.

Browsing takes every message with ``basic.get`` (no ack), reads it, then returns each one with its
own ``nack(requeue)``, in the order it was read, so the queue keeps its order. While the tool runs,
the messages it holds are unacked, not gone: if the tool dies the broker returns them. Each browse
counts as a delivery (the ``x-delivery-count`` header rises by one); the dead-letter queue's
delivery limit is set far out of reach so that inspecting never drops anything.
"""

from __future__ import annotations

import hashlib
import json
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from types import TracebackType
from typing import Any

from aio_pika.abc import AbstractChannel, AbstractConnection, AbstractIncomingMessage, AbstractQueue

from consumer import headers as h
from consumer.envelope import EnvelopeParser, check_content_type
from consumer.errors import Poison, PoisonReason, PublishFailed, error_name
from consumer.publisher import Publisher, copy_properties
from consumer.registry import HandlerRegistry

__all__ = [
    "EXPIRED",
    "REFUSED_EXPIRED",
    "DeadLetterQueue",
    "DeadMessage",
    "ReplayResult",
    "Selection",
    "counts",
    "read_dead_letter",
    "renewed",
    "replay",
]

EXPIRED = "expired"
REFUSED_EXPIRED = (
    "expired: its occurred_at is older than the receipts kept (CONSUMER_RECEIPT_RETENTION), so "
    "the service would refuse it again, and no receipt can say whether it was applied before; "
    "--force replays it as a new event (occurred_at set to now, the old one kept in the "
    f"{h.ORIGINAL_OCCURRED_AT} header): applied even if a copy was applied before"
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


def _event_id_from(body: bytes) -> str | None:
    try:
        decoded = json.loads(body)
    except (ValueError, UnicodeDecodeError, RecursionError):
        return None
    if isinstance(decoded, dict) and isinstance(decoded.get("event_id"), str):
        return str(decoded["event_id"])[:64]
    return None


def read_dead_letter(
    message: AbstractIncomingMessage,
    position: int,
    *,
    registry: HandlerRegistry,
    parser: EnvelopeParser,
) -> DeadMessage:
    """What a dead letter says about itself; poison is parsed again to say why it failed."""
    headers = dict(message.headers or {})
    body = message.body
    event_type: str | None = None
    event_id: str | None = None
    poison: Poison | None = None
    try:
        check_content_type(message.content_type, message.content_encoding)
        parser.check_headers(headers)
        raw = parser.parse(body)
        event_id, event_type = str(raw.event_id), raw.type
        registry.resolve(raw)
    except Poison as error:
        poison = error
        event_id = event_id or _event_id_from(body)
    except Exception as error:  # a payload validator's own exception: as the service judged it
        poison = Poison(
            PoisonReason.INVALID_PAYLOAD, f"{error_name(error)}: {error}", error_name(error)
        )
        event_id = event_id or _event_id_from(body)
    reason = h.text(headers.get(h.REASON))
    if reason is None:
        # The newest x-death entry says why it is here now; the first death may be a retry
        # rung's expiry long before.
        broker_reason = (
            h.text((_newest_death(headers) or {}).get("reason"))
            or h.text(headers.get("x-first-death-reason"))
            or "?"
        )
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


class DeadLetterQueue:
    """The dead-letter queue, held for one operation: read everything, then settle each message.

    On exit every message not taken is returned to the queue, one nack each, in reading order.
    """

    def __init__(
        self,
        connection: AbstractConnection,
        *,
        queue: str,
        registry: HandlerRegistry,
        parser: EnvelopeParser,
    ) -> None:
        self._connection = connection
        self._queue_name = queue
        self._registry = registry
        self._parser = parser
        self._channel: AbstractChannel | None = None
        self._queue: AbstractQueue | None = None
        self._held: list[tuple[AbstractIncomingMessage, DeadMessage]] = []
        self._taken: set[int] = set()
        self._present = 0

    async def __aenter__(self) -> DeadLetterQueue:
        self._channel = await self._connection.channel(publisher_confirms=False)
        self._queue = await self._channel.declare_queue(self._queue_name, passive=True)
        # What is there now is what an operation sees: letters that keep arriving while it reads
        # (a crash loop dead-lettering away) must not keep it reading, and holding, for ever.
        self._present = int(self._queue.declaration_result.message_count or 0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        channel, self._channel = self._channel, None
        if channel is None or channel.is_closed:
            return
        for message, letter in self._held:
            if letter.position not in self._taken:
                await message.nack(requeue=True)
        await channel.close()

    async def read(self, limit: int | None = None) -> list[DeadMessage]:
        """The messages in the queue when it was opened (up to ``limit``), held unacked, in
        queue order."""
        assert self._queue is not None
        letters: list[DeadMessage] = []
        bound = self._present if limit is None else min(limit, self._present)
        while len(letters) < bound:
            message = await self._queue.get(no_ack=False, fail=False)
            if message is None:
                break
            letter = read_dead_letter(
                message, len(self._held), registry=self._registry, parser=self._parser
            )
            self._held.append((message, letter))
            letters.append(letter)
        return letters

    async def take(self, letter: DeadMessage) -> None:
        """Remove a held message from the queue (ack it)."""
        message, _ = self._held[letter.position]
        await message.ack()
        self._taken.add(letter.position)

    def message(self, letter: DeadMessage) -> AbstractIncomingMessage:
        return self._held[letter.position][0]

    async def purge(self) -> int:
        """Delete every message in the queue that nobody holds; returns how many."""
        assert self._queue is not None
        result = await self._queue.purge()
        return int(result.message_count or 0)


@dataclass(frozen=True, slots=True)
class ReplayResult:
    replayed: list[DeadMessage]
    failed: list[tuple[DeadMessage, str]]


async def replay(
    dead: DeadLetterQueue,
    letters: Sequence[DeadMessage],
    publisher: Publisher,
    *,
    exchange: str,
    force: bool = False,
) -> ReplayResult:
    """Publish each letter to ``exchange`` with its event type as the routing key and the attempt
    count reset, wait for the confirm, then remove the dead copy. A failed publish leaves it in
    place, as does a letter with no valid envelope, and an expired one unless ``force`` (then it
    goes as a new event: :func:`renewed`)."""
    replayed: list[DeadMessage] = []
    failed: list[tuple[DeadMessage, str]] = []
    for letter in letters:
        if letter.type is None:
            failed.append((letter, "not a valid envelope: there is no event to replay"))
            continue
        if letter.expired and not force:
            failed.append((letter, REFUSED_EXPIRED))
            continue
        original = dead.message(letter)
        headers = h.replay_headers(letter.headers)
        body = original.body
        if letter.expired:
            body, headers[h.ORIGINAL_OCCURRED_AT] = renewed(body, datetime.now(UTC))
        properties = copy_properties(original.properties, headers=headers)
        try:
            # The validated event type, never a routing key a header claims: a producer could
            # otherwise have the replay delivered wherever it likes.
            await publisher.publish(body, properties, exchange=exchange, routing_key=letter.type)
        except PublishFailed as error:
            failed.append((letter, str(error)))
            continue
        await dead.take(letter)
        replayed.append(letter)
    return ReplayResult(replayed, failed)


def renewed(body: bytes, now: datetime) -> tuple[bytes, str]:
    """An expired event's body with ``occurred_at`` set to ``now``, and the old value: to the
    receipts a new event, since (event_id, occurred_at) is what they deduplicate on."""
    envelope = json.loads(body)
    before = str(envelope["occurred_at"])
    envelope["occurred_at"] = now.isoformat()
    return json.dumps(envelope, ensure_ascii=False, separators=(",", ":")).encode(), before
