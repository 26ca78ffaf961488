"""What a scenario publishes, and what must become of each message.

A workload is a list of unique events of known kinds, plus republished duplicates (the same body
and event id published again, as a producer retry does), in publishing order. Every publication
has a message id of its own (``<key>.<copy>``), so each copy that ends in the dead-letter queue can
be told apart: a dead-lettered event that was published twice is expected there twice.

Every scenario sends the normal mix:

================  ==================================================  =============================
kind              message                                             must end as
================  ==================================================  =============================
applied           ``test.behave*`` with a unique key                  one receipt, one effect
restock           ``inventory.restock`` of one of a few SKUs          one receipt, one movement
reserve           ``inventory.reserve`` of one of those SKUs          one receipt, one movement
notify            ``notification.requested``                          one receipt, one notification
flaky             ``test.behave*``, ``fail_transient`` 1 or 2         retried, then applied
permanent         ``test.behave*``, ``permanent``                     dead: permanent_failure
bug               ``test.behave``, ``bug`` (an unclassified error)    dead: permanent_failure
not_json          a body that is not JSON                             dead (poison): not_json
invalid_envelope  an envelope whose ``type`` is a number              dead: invalid_envelope
unknown_type      an envelope of a type no handler has, under its     dead: unknown_type
                  own routing key (bound by the runner)
invalid_payload   ``test.behave`` with a payload its model refuses    dead: invalid_payload
================  ==================================================  =============================

The SKUs start with :data:`SEED_STOCK` each (the runner seeds them), far more than every reserve
together takes, so every reserve succeeds whatever the order: ``stock.available`` must end at the
seed plus the restocks minus the reserves, exactly.

Handler faults, mixed in only where a scenario asks for them (a number of events each):

================  ==================================================  =============================
kind              message                                             must end as
================  ==================================================  =============================
swallow           ``test.behave*``, ``swallow`` (catches a unique     dead: permanent_failure,
                  violation without a savepoint)                      SwallowedDatabaseError
block             ``test.behave``, ``block_s`` past the hard limit    dead: hard_time_limit
crash             ``test.behave``, ``crash`` (``os._exit(17)``)       dead: crashed
kill_connection   ``test.behave``, ``kill_connection``                dead: connection_lost
odd               ``test.odd`` with a string ``name``                 one receipt, one effect
odd_poison        ``test.odd`` with ``name: 5`` (its validator        dead: invalid_payload,
                  raises AttributeError)                              AttributeError, with headers
slow_duplicate    ``test.behave``, ``sleep_s`` near the handler       one receipt, one effect
                  timeout, published twice back to back
stall             ``test.behave``, ``sleep_s`` 3s on its first call   one receipt, one effect
                  (a stalled handler; ``queue-table``: 5s timeout)
================  ==================================================  =============================

Outbox causes (issue 34), mixed in the same way: each publishes 1 to 3 ``test.outboxed`` follow-ups
through ``event.publish`` (keyed by the cause's key: its follow-ups are published in order), whose
handler records one ``test_effects`` row per follow-up (``tests.handlers.outboxing``):

================  ==================================================  =============================
kind              message                                             must end as
================  ==================================================  =============================
outbox            ``test.outbox*``, ``count`` 1 to 3                  one receipt, one effect; each
                                                                      follow-up one outbox row,
                                                                      sent, applied once
outbox_flaky      the same, ``fail_transient`` 1: publishes, then     retried, then as ``outbox``
                  fails (its rows rolled back), applied on retry      (one row per follow-up id)
outbox_permanent  the same, ``permanent``: publishes, then fails for  dead: permanent_failure; the
                  good                                                ids its follow-ups would have
                                                                      had nowhere (no row, receipt
                                                                      or effect)
================  ==================================================  =============================

A follow-up's ``event_id`` is derived from its cause's, the consumer's name and its position
(:func:`consumer.outbox.follow_up_id`): :meth:`Workload.follow_ups` gives every id a scenario's
causes write, or would have written.

A hostile producer's messages, mixed in the same way (:mod:`.hostile` puts them on the wire):

=========================  ===========================================  ===========================
kind                       message                                      must end as
=========================  ===========================================  ===========================
headers_too_deep           ``test.behave`` that would apply, header     dead (poison):
                           ``x-anything`` a table nested 3,000 deep     headers_too_deep
too_complex                ``notification.requested``, ``params``       dead (poison): too_complex
                           holding 12,000 empty arrays (36 KB)
hostile_headers            ``test.behave*``, ``fail_transient`` 1, and  retried once, then one
                           in turn: ``consumer-attempt`` of 5,000       receipt, one effect
                           digits, a string header that is not UTF-8,
                           a header double of 1e300, a message id
                           that is not UTF-8
hostile_headers_permanent  the same, ``permanent``                      dead: permanent_failure,
                                                                        PermanentError, the true
                                                                        routing key and attempt
                                                                        count, the header kept
forged_headers             ``test.behave*``, ``permanent``, with        dead: permanent_failure,
                           ``consumer-original-routing-key:             PermanentError, the true
                           payments.refund``, ``consumer-dead-reason:   routing key
                           all is well``, ``consumer-error-class:
                           Forged``
=========================  ===========================================  ===========================

Every dead copy here is one the service dead-letters itself, poison included: it carries
``consumer-dead-reason`` (and ``consumer-error-class``) and no ``x-death``. Events that end the
process or its connection (``block``, ``crash``, ``kill_connection``) and the slow ones (published
twice on purpose) are never republished as random duplicates, so each costs a known number of
publications.

``test.behave*`` is ``test.behave`` or, for half of them at random, its batch form
``test.behave_many``: the batch handler path must keep every promise too.
"""

from __future__ import annotations

import enum
import json
import random
import uuid
from collections import Counter
from collections.abc import Collection, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from consumer.cli.producer import envelope_body
from consumer.outbox import follow_up_id
from tests.chaos.hostile import COMPLEX_ARRAYS, SAFE_ONCE_READ, Wire, sent_id

BEHAVE = "test.behave"
BEHAVE_MANY = "test.behave_many"
ODD = "test.odd"
RESTOCK = "inventory.restock"
RESERVE = "inventory.reserve"
NOTIFY = "notification.requested"
OUTBOX = "test.outbox"
OUTBOX_MANY = "test.outbox_many"
OUTBOX_HANDLERS = "tests.handlers.outboxing"
"""The handlers of the outbox causes and their follow-ups: added to a scenario's
``CONSUMER_HANDLERS`` where it mixes them in."""
MAX_FOLLOW_UPS = 3
"""The most follow-ups one outbox cause publishes."""
UNKNOWN = "chaos.unknown"
"""A type no handler takes: the runner binds it to the work queue, as a handler removed since the
topology was applied leaves it (under another type's routing key it would be
``routing_key_mismatch``)."""
SKUS = tuple(f"CHAOS-{n}" for n in range(8))
SEED_STOCK = 1_000_000
"""Each SKU's stock before the scenario: more than every reserve of a long run takes together."""
MAX_QTY = 5
"""The largest quantity a restock adds or a reserve takes."""
DUPLICATE_SHARE = 0.10
"""Of all publications, the share that republishes an event already published."""
BLOCK_S = 5.0
"""How long a ``block`` event blocks the event loop: past any hard time limit a scenario sets."""
SLOW_S = 0.8
"""How long a ``slow_duplicate`` event sleeps: near the 1s handler timeout, inside it."""
STALL_S = 3.0
"""How long a ``stall`` event awaits on its first call: within the handler timeout of the queue
that takes it (``queue-table``'s faulty queue: 5s), far past every other queue's work."""
RETRY_RUNGS = 3
"""Rungs of the test environment's retry ladder (``200ms,400ms,800ms``): no event is retried
more often, so no dead copy's ``consumer-attempt`` is higher."""


class Kind(enum.Enum):
    APPLIED = "applied"
    RESTOCK = "restock"
    RESERVE = "reserve"
    NOTIFY = "notify"
    FLAKY = "flaky"
    PERMANENT = "permanent"
    BUG = "bug"
    NOT_JSON = "not_json"
    INVALID_ENVELOPE = "invalid_envelope"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_PAYLOAD = "invalid_payload"
    # Handler faults: only where a scenario mixes them in.
    SWALLOW = "swallow"
    BLOCK = "block"
    CRASH = "crash"
    KILL_CONNECTION = "kill_connection"
    ODD = "odd"
    ODD_POISON = "odd_poison"
    SLOW_DUPLICATE = "slow_duplicate"
    STALL = "stall"
    # Hostile producers: only where a scenario mixes them in.
    HEADERS_TOO_DEEP = "headers_too_deep"
    TOO_COMPLEX = "too_complex"
    HOSTILE_HEADERS = "hostile_headers"
    HOSTILE_HEADERS_PERMANENT = "hostile_headers_permanent"
    FORGED_HEADERS = "forged_headers"
    # Issue 29's: oversized bodies, header floods, forged dead letters, routing, ids.
    BODY_TOO_LARGE = "body_too_large"
    HEADERS_TOO_LARGE = "headers_too_large"
    HEADERS_UNREADABLE = "headers_unreadable"
    FORGED_DEAD_LETTER = "forged_dead_letter"
    ROUTING_KEY_MISMATCH = "routing_key_mismatch"
    ID_CONFLICT = "id_conflict"
    # The transactional outbox (issue 34): only where a scenario mixes them in.
    OUTBOX = "outbox"
    OUTBOX_FLAKY = "outbox_flaky"
    OUTBOX_PERMANENT = "outbox_permanent"

    @property
    def applies(self) -> bool:
        """Its effect must be applied exactly once."""
        return self in _APPLIES

    @property
    def poison(self) -> bool:
        """Poison: never processable, dead-lettered at once by the service, its poison reason in
        ``consumer-dead-reason``."""
        return self in _POISON

    @property
    def dead_reason(self) -> str | None:
        """The reason ``dlq list`` must give for each dead copy; None for kinds that apply."""
        if self.applies:
            return None
        if self.poison:
            return _POISON_REASONS.get(self, self.value)
        return _SERVICE_REASONS.get(self, "permanent_failure")

    @property
    def header_reason(self) -> str | None:
        """The ``consumer-dead-reason`` header its dead copies must carry (None: none at all;
        on a broker's letter, whatever the producer wrote, see :attr:`by_broker`)."""
        return None if self.by_broker else self.dead_reason

    @property
    def by_broker(self) -> bool:
        """Poison the service nacks, so that the broker dead-letters the original with the
        producer's headers and its own ``x-death`` (``rejected``): no copy can carry it. ``dlq``
        judges the letter again for its reason and says the broker dead-lettered it."""
        return self in (Kind.BODY_TOO_LARGE, Kind.HEADERS_TOO_LARGE)

    @property
    def error_class(self) -> str | None:
        """The class its dead copies' ``consumer-error-class`` must name, where that is part of
        the promise (None: not checked)."""
        return _ERROR_CLASSES.get(self)

    @property
    def true_headers(self) -> bool:
        """Its producer forged or broke ``consumer-*`` headers: its dead copies must carry the
        service's own (the event's routing key, an attempt count the ladder can reach)."""
        return self in (
            Kind.HOSTILE_HEADERS_PERMANENT,
            Kind.FORGED_HEADERS,
            Kind.FORGED_DEAD_LETTER,
        )

    @property
    def republished(self) -> bool:
        """It may be picked as a random duplicate (see the module docstring)."""
        return self not in (
            Kind.BLOCK,
            Kind.CRASH,
            Kind.KILL_CONNECTION,
            Kind.SLOW_DUPLICATE,
            Kind.ID_CONFLICT,
        )

    @property
    def table(self) -> str:
        """Where its effect is: ``test_effects``, ``stock_movements`` or ``notifications``."""
        if self in (Kind.RESTOCK, Kind.RESERVE, Kind.ROUTING_KEY_MISMATCH):
            return "stock_movements"
        if self in (Kind.NOTIFY, Kind.TOO_COMPLEX, Kind.ID_CONFLICT):
            return "notifications"
        return "test_effects"


_APPLIES = frozenset(
    {
        Kind.APPLIED,
        Kind.RESTOCK,
        Kind.RESERVE,
        Kind.NOTIFY,
        Kind.FLAKY,
        Kind.ODD,
        Kind.SLOW_DUPLICATE,
        Kind.STALL,
        Kind.HOSTILE_HEADERS,
        Kind.OUTBOX,
        Kind.OUTBOX_FLAKY,
    }
)
_POISON = frozenset(
    {
        Kind.NOT_JSON,
        Kind.INVALID_ENVELOPE,
        Kind.UNKNOWN_TYPE,
        Kind.INVALID_PAYLOAD,
        Kind.HEADERS_TOO_DEEP,
        Kind.TOO_COMPLEX,
        Kind.BODY_TOO_LARGE,
        Kind.HEADERS_TOO_LARGE,
        Kind.HEADERS_UNREADABLE,
        Kind.FORGED_DEAD_LETTER,
        Kind.ROUTING_KEY_MISMATCH,
    }
)
_POISON_REASONS = {Kind.FORGED_DEAD_LETTER: "not_json"}
"""Poison whose reason is not its kind's name."""
_SERVICE_REASONS = {
    Kind.BLOCK: "hard_time_limit",
    Kind.CRASH: "crashed",
    Kind.KILL_CONNECTION: "connection_lost",
    Kind.ODD_POISON: "invalid_payload",
    Kind.ID_CONFLICT: "id_conflict",
}
_ERROR_CLASSES = {
    Kind.SWALLOW: "SwallowedDatabaseError",
    Kind.ODD_POISON: "AttributeError",
    Kind.HOSTILE_HEADERS_PERMANENT: "PermanentError",
    Kind.FORGED_HEADERS: "PermanentError",
}

HANDLER_FAULTS = frozenset(
    {
        Kind.SWALLOW,
        Kind.BLOCK,
        Kind.CRASH,
        Kind.KILL_CONNECTION,
        Kind.ODD,
        Kind.ODD_POISON,
        Kind.SLOW_DUPLICATE,
        Kind.STALL,
    }
)
"""The handler faults a scenario mixes in by number (:func:`plan_workload`'s ``faults``)."""

HOSTILE_29 = frozenset(
    {
        Kind.BODY_TOO_LARGE,
        Kind.HEADERS_TOO_LARGE,
        Kind.HEADERS_UNREADABLE,
        Kind.FORGED_DEAD_LETTER,
        Kind.ROUTING_KEY_MISMATCH,
        Kind.ID_CONFLICT,
    }
)
"""Issue 29's hostile kinds, whose listing says who dead-lettered them."""

HOSTILE = (
    frozenset(
        {
            Kind.HEADERS_TOO_DEEP,
            Kind.TOO_COMPLEX,
            Kind.HOSTILE_HEADERS,
            Kind.HOSTILE_HEADERS_PERMANENT,
            Kind.FORGED_HEADERS,
        }
    )
    | HOSTILE_29
)
"""A hostile producer's messages, mixed in by number like the handler faults."""
ATTACK = frozenset({Kind.BODY_TOO_LARGE, Kind.HEADERS_TOO_LARGE})
"""The costly ones: sent in a burst among innocent events whose throughput is measured
(:func:`plan_block`)."""
OVERSIZED_BYTES = 4 * 1024 * 1024
"""A ``body_too_large`` body, unless the profile says otherwise: 16 times the 256 KiB limit."""
ROUTED_QTY = 500
"""What an ``inventory.restock`` under a ``notification.*`` key would have added (issue 29)."""
OUTBOX_CAUSES = frozenset({Kind.OUTBOX, Kind.OUTBOX_FLAKY, Kind.OUTBOX_PERMANENT})
"""Events whose handler publishes follow-ups through the outbox (issue 34)."""
MIXED_IN = HANDLER_FAULTS | HOSTILE | OUTBOX_CAUSES
"""Every kind a scenario mixes in by number."""

# Shares of the unique events of the normal mix; the duplicates come on top (DUPLICATE_SHARE of
# all publications), the handler faults in their place.
MIX: Mapping[Kind, float] = {
    Kind.APPLIED: 0.50,
    Kind.RESTOCK: 0.08,
    Kind.RESERVE: 0.08,
    Kind.NOTIFY: 0.04,
    Kind.FLAKY: 0.12,
    Kind.PERMANENT: 0.05,
    Kind.BUG: 0.03,
    Kind.NOT_JSON: 0.025,
    Kind.INVALID_ENVELOPE: 0.025,
    Kind.UNKNOWN_TYPE: 0.025,
    Kind.INVALID_PAYLOAD: 0.025,
}


@dataclass(frozen=True, slots=True)
class PlannedEvent:
    key: str
    """Unique in the scenario: ``test_effects.key`` and the stem of every message id."""
    kind: Kind
    event_id: uuid.UUID | None
    """None only for bodies that are not JSON."""
    routing_key: str
    body: bytes
    sku: str | None = None
    qty: int = 0
    wire: Wire | None = None
    """A hostile producer's headers or properties around the body (:mod:`.hostile`)."""
    victim: str | None = None
    """``id_conflict``: the key of the event whose ``event_id`` and ``occurred_at`` it reuses."""
    follow_ups: int = 0
    """An outbox cause: how many follow-ups its handler publishes (and, for one that fails for
    good, would have)."""


@dataclass(frozen=True, slots=True)
class Publication:
    event: PlannedEvent
    copy: int
    """0 for the first publication, 1 for the republished duplicate."""

    @property
    def message_id(self) -> str:
        return f"{self.event.key}.{self.copy}"


def attempt_id(publication: Publication, attempt: int) -> str:
    """The message id of a publish attempt: a re-send after an unconfirmed one gets its own."""
    return publication.message_id if attempt == 0 else f"{publication.message_id}~{attempt}"


def publication_of(message_id: str) -> str:
    """The publication a message id (of any attempt, as sent or as read back) belongs to."""
    return sent_id(message_id).split("~", 1)[0]


@dataclass(frozen=True)
class Workload:
    events: tuple[PlannedEvent, ...]
    publications: tuple[Publication, ...]
    """In publishing order."""
    by_key: dict[str, PlannedEvent] = field(init=False, repr=False, compare=False)
    by_event_id: dict[uuid.UUID, PlannedEvent] = field(init=False, repr=False, compare=False)
    by_message_id: dict[str, Publication] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "by_key", {event.key: event for event in self.events})
        object.__setattr__(
            self,
            "by_event_id",
            {
                event.event_id: event
                for event in self.events
                if event.event_id is not None and event.kind is not Kind.ID_CONFLICT
            },
        )
        object.__setattr__(self, "by_message_id", {p.message_id: p for p in self.publications})

    def listed_event(self, event_id: uuid.UUID, event_type: object) -> PlannedEvent | None:
        """The event a dead letter of ``event_id`` and ``event_type`` is: an ``id_conflict``
        shares its victim's id under another type."""
        for event in self.of_kind(Kind.ID_CONFLICT):
            if event.event_id == event_id and event.routing_key == event_type:
                return event
        return self.by_event_id.get(event_id)

    def of_kind(self, *kinds: Kind) -> Iterator[PlannedEvent]:
        return (event for event in self.events if event.kind in kinds)

    @property
    def to_apply(self) -> int:
        return sum(1 for event in self.events if event.kind.applies)

    @property
    def effects_due(self) -> int:
        """Effects once everything is applied: one per event that must apply, plus one per
        follow-up its outbox causes publish."""
        return self.to_apply + sum(
            event.follow_ups for event in self.of_kind(*OUTBOX_CAUSES) if event.kind.applies
        )

    def follow_ups(self, consumer: str) -> dict[uuid.UUID, tuple[PlannedEvent, int]]:
        """Every follow-up id the outbox causes write under ``consumer`` (``CONSUMER_NAME``), or
        would have written had they not failed for good: its cause and its position."""
        found: dict[uuid.UUID, tuple[PlannedEvent, int]] = {}
        for event in self.of_kind(*OUTBOX_CAUSES):
            assert event.event_id is not None
            for position in range(event.follow_ups):
                found[follow_up_id(event.event_id, consumer, position)] = (event, position)
        return found

    def publications_of(self, event: PlannedEvent) -> list[Publication]:
        return [
            publication
            for copy in (0, 1)
            if (publication := self.by_message_id.get(f"{event.key}.{copy}")) is not None
        ]

    @property
    def tail(self) -> tuple[Publication, ...]:
        """The ``id_conflict`` publications: last, each published once its victim is applied, so
        that the innocent is the one applied (the first to commit an id keeps it: a hostile copy
        first would be applied and the innocent dead-lettered ``id_conflict``, which is why ids
        must be unguessable)."""
        return tuple(p for p in self.publications if p.event.kind is Kind.ID_CONFLICT)

    @property
    def victims(self) -> list[uuid.UUID]:
        """The event ids the ``id_conflict`` events reuse."""
        return [e.event_id for e in self.of_kind(Kind.ID_CONFLICT) if e.event_id is not None]

    def stock(self) -> dict[str, int]:
        """What ``stock.available`` must be per SKU once every restock and every reserve is
        applied once: the seed, plus the restocks, minus the reserves."""
        totals = dict.fromkeys(SKUS, SEED_STOCK)
        for event in self.of_kind(Kind.RESTOCK, Kind.RESERVE):
            assert event.sku is not None
            sign = 1 if event.kind is Kind.RESTOCK else -1
            totals[event.sku] += sign * event.qty
        return totals


def _occurred_at() -> str:
    return datetime.now(UTC).isoformat()


def _event(
    kind: Kind,
    key: str,
    rng: random.Random,
    turn: int = 0,
    *,
    oversized: int = OVERSIZED_BYTES,
) -> PlannedEvent:
    """An event of ``kind``; ``turn`` (its number among its kind's) picks the hostile headers of
    the ``hostile_headers*`` kinds, each in turn, and of the header floods. An ``id_conflict``
    gets its victim's id in :func:`_collide`."""
    event_id = uuid.UUID(int=rng.getrandbits(128), version=4)
    if kind is Kind.ROUTING_KEY_MISMATCH:
        # Issue 29: a producer allowed only notification.* raises the stock by 500.
        sku = rng.choice(SKUS)
        body = envelope_body(RESTOCK, {"sku": sku, "qty": ROUTED_QTY}, event_id=event_id)
        return PlannedEvent(key, kind, event_id, NOTIFY, body, sku, ROUTED_QTY)
    if kind is Kind.FORGED_DEAD_LETTER:
        body = f"chaos {key}: {{not json, forged dead-letter headers".encode()
        return PlannedEvent(key, kind, event_id, BEHAVE, body, wire=Wire.FORGED_DEAD)
    if kind is Kind.BODY_TOO_LARGE:
        # An event that would apply but for its size; its producer forged the dead-letter
        # headers too, which the broker's letter keeps and dlq must not present as the service's.
        padded = {"key": key, "padding": "x" * oversized}
        body = envelope_body(BEHAVE, padded, event_id=event_id)
        return PlannedEvent(key, kind, event_id, BEHAVE, body, wire=Wire.FORGED_DEAD)
    if kind in (Kind.HEADERS_TOO_LARGE, Kind.HEADERS_UNREADABLE):
        flood = (Wire.FLOOD, Wire.WIDE)[turn % 2]
        body = envelope_body(BEHAVE, {"key": key}, event_id=event_id)
        return PlannedEvent(
            key,
            kind,
            event_id,
            BEHAVE,
            body,
            wire=flood if kind is Kind.HEADERS_TOO_LARGE else Wire.KEY_TWICE,
        )
    if kind in (Kind.RESTOCK, Kind.RESERVE):
        sku, qty = rng.choice(SKUS), rng.randint(1, MAX_QTY)
        if kind is Kind.RESTOCK:
            body = envelope_body(RESTOCK, {"sku": sku, "qty": qty}, event_id=event_id)
            return PlannedEvent(key, kind, event_id, RESTOCK, body, sku, qty)
        order = {"order_id": f"order-{key}", "sku": sku, "qty": qty}
        body = envelope_body(RESERVE, order, event_id=event_id)
        return PlannedEvent(key, kind, event_id, RESERVE, body, sku, qty)
    if kind is Kind.NOTIFY:
        request = {"recipient": f"{key}@chaos.test", "template": "chaos", "params": {"key": key}}
        return PlannedEvent(
            key, kind, event_id, NOTIFY, envelope_body(NOTIFY, request, event_id=event_id)
        )
    if kind in (Kind.ODD, Kind.ODD_POISON):
        odd = {"key": key, "name": f" {key} " if kind is Kind.ODD else 5}
        return PlannedEvent(key, kind, event_id, ODD, envelope_body(ODD, odd, event_id=event_id))
    if kind is Kind.TOO_COMPLEX:
        # Tiny arrays, many thousand of them: past the container bound, far within the size one.
        arrays: dict[str, list[list[int]]] = {"items": [[]] * COMPLEX_ARRAYS}
        request = {"recipient": f"{key}@chaos.test", "template": "chaos", "params": arrays}
        return PlannedEvent(
            key, kind, event_id, NOTIFY, envelope_body(NOTIFY, request, event_id=event_id)
        )
    if kind in OUTBOX_CAUSES:
        count = rng.randint(1, MAX_FOLLOW_UPS)
        emit: dict[str, object] = {"key": key, "count": count}
        if kind is Kind.OUTBOX_FLAKY:
            emit["fail_transient"] = 1
        elif kind is Kind.OUTBOX_PERMANENT:
            emit["permanent"] = True
        event_type = rng.choice((OUTBOX, OUTBOX_MANY))
        body = envelope_body(event_type, emit, event_id=event_id)
        return PlannedEvent(key, kind, event_id, event_type, body, follow_ups=count)
    if kind is Kind.NOT_JSON:
        return PlannedEvent(key, kind, None, BEHAVE, f"chaos {key}: {{not json".encode())
    if kind is Kind.INVALID_ENVELOPE:
        envelope = {
            "event_id": str(event_id),
            "type": 42,
            "occurred_at": _occurred_at(),
            "payload": {"key": key},
        }
        return PlannedEvent(key, kind, event_id, BEHAVE, json.dumps(envelope).encode())
    if kind is Kind.UNKNOWN_TYPE:
        body = envelope_body(UNKNOWN, {"key": key}, event_id=event_id)
        return PlannedEvent(key, kind, event_id, UNKNOWN, body)
    payload: dict[str, object] = {"key": key}
    event_type = BEHAVE
    wire: Wire | None = None
    if kind in _EITHER_HANDLER:
        event_type = rng.choice((BEHAVE, BEHAVE_MANY))
    if kind is Kind.FLAKY:
        payload["fail_transient"] = rng.choice((1, 2))
    elif kind in (Kind.PERMANENT, Kind.HOSTILE_HEADERS_PERMANENT, Kind.FORGED_HEADERS):
        payload["permanent"] = True
    elif kind is Kind.BUG:
        payload["bug"] = True
    elif kind is Kind.INVALID_PAYLOAD:
        payload["fail_transient"] = "twice"
    elif kind is Kind.SWALLOW:
        payload["swallow"] = True
    elif kind is Kind.BLOCK:
        payload["block_s"] = BLOCK_S
    elif kind is Kind.CRASH:
        payload["crash"] = True
    elif kind is Kind.KILL_CONNECTION:
        payload["kill_connection"] = True
    elif kind is Kind.SLOW_DUPLICATE:
        payload["sleep_s"] = SLOW_S
    elif kind is Kind.STALL:
        # Its first call only: it holds its queue's worker, then is applied.
        payload["sleep_s"] = STALL_S
        payload["sleep_calls"] = 1
    elif kind is Kind.HOSTILE_HEADERS:
        # Once through the retry ladder: the service's own attempt count must be the one that
        # counts, and the headers, made safe, must travel to the delay queue and back.
        payload["fail_transient"] = 1
    if kind in (Kind.HOSTILE_HEADERS, Kind.HOSTILE_HEADERS_PERMANENT):
        wire = SAFE_ONCE_READ[turn % len(SAFE_ONCE_READ)]
    elif kind is Kind.FORGED_HEADERS:
        wire = Wire.FORGED
    elif kind is Kind.HEADERS_TOO_DEEP:
        wire = Wire.DEEP_HEADERS  # on a body that would apply
    body = envelope_body(event_type, payload, event_id=event_id)
    return PlannedEvent(key, kind, event_id, event_type, body, wire=wire)


_EITHER_HANDLER = frozenset(
    {
        Kind.APPLIED,
        Kind.FLAKY,
        Kind.PERMANENT,
        Kind.SWALLOW,
        Kind.HOSTILE_HEADERS,
        Kind.HOSTILE_HEADERS_PERMANENT,
        Kind.FORGED_HEADERS,
    }
)
"""Kinds sent as ``test.behave`` or, for half of them at random, ``test.behave_many``."""


def _collide(events: list[PlannedEvent], rng: random.Random) -> list[PlannedEvent]:
    """Each ``id_conflict`` event made a ``notification.requested`` with the ``event_id`` and
    ``occurred_at`` of an ``applied`` event of its own (its victim), as a producer that can derive
    another's ids would send it."""
    victims = iter(
        rng.sample(
            [event for event in events if event.kind is Kind.APPLIED],
            sum(1 for event in events if event.kind is Kind.ID_CONFLICT),
        )
    )
    made: list[PlannedEvent] = []
    for event in events:
        if event.kind is Kind.ID_CONFLICT:
            victim = next(victims)
            assert victim.event_id is not None
            occurred_at = datetime.fromisoformat(json.loads(victim.body)["occurred_at"])
            request = {"recipient": f"{event.key}@chaos.test", "template": "chaos", "params": {}}
            body = envelope_body(NOTIFY, request, event_id=victim.event_id, occurred_at=occurred_at)
            event = PlannedEvent(
                event.key, event.kind, victim.event_id, NOTIFY, body, victim=victim.key
            )
        made.append(event)
    return made


def plan_block(
    prefix: str,
    innocents: int,
    *,
    seed: int,
    burst: Mapping[Kind, int] | None = None,
    oversized: int = OVERSIZED_BYTES,
) -> Workload:
    """``innocents`` ``applied`` events keyed ``<prefix>NNNNN``, with ``burst`` (so many of each
    hostile kind) spread evenly among them; no duplicates. The blocks whose innocents' throughput
    the hostile scenario measures, clean and under attack."""
    rng = random.Random(seed)
    kinds = [Kind.APPLIED] * innocents
    hostile = [kind for kind, count in (burst or {}).items() for _ in range(count)]
    for n, kind in enumerate(hostile):
        kinds.insert(round((n + 0.5) * len(kinds) / len(hostile)), kind)
    turns: Counter[Kind] = Counter()
    events: list[PlannedEvent] = []
    for n, kind in enumerate(kinds):
        events.append(_event(kind, f"{prefix}{n:05d}", rng, turns[kind], oversized=oversized))
        turns[kind] += 1
    return Workload(tuple(events), tuple(Publication(event, 0) for event in events))


def combine(*workloads: Workload) -> Workload:
    """One workload of several published one after the other (their keys must differ)."""
    return Workload(
        tuple(event for workload in workloads for event in workload.events),
        tuple(publication for workload in workloads for publication in workload.publications),
    )


def check_faults(total: int, faults: Mapping[Kind, int]) -> None:
    """Raise ValueError unless ``faults`` fit in a workload of ``total`` publications: handler
    faults and hostile messages only, at most half the unique events, a duplicate for every slow
    event."""
    if strangers := sorted(kind.value for kind in set(faults) - MIXED_IN):
        raise ValueError(f"not kinds to mix in: {', '.join(strangers)}")
    duplicates = round(total * DUPLICATE_SHARE)
    if faults.get(Kind.SLOW_DUPLICATE, 0) > duplicates or sum(faults.values()) > (
        (total - duplicates) // 2
    ):
        raise ValueError(f"too many mixed-in events for {total} publications: {dict(faults)}")


def plan_workload(
    total: int,
    *,
    seed: int,
    retry_rungs: int = RETRY_RUNGS,
    faults: Mapping[Kind, int] | None = None,
    oversized: int = OVERSIZED_BYTES,
) -> Workload:
    """``total`` publications: unique events in the proportions of :data:`MIX`, with ``faults``
    (so many events of each handler-fault kind) in place of some of them, then
    :data:`DUPLICATE_SHARE` of ``total`` republished: a random event a little after its first
    copy, and every ``slow_duplicate`` right after its first copy. Every ``id_conflict`` goes
    last, after every other publication (the runner holds it until its victim is applied: see
    :attr:`Workload.tail`).

    ``fail_transient`` stays below ``retry_rungs`` so that flaky events end up applied.
    """
    if total < 20:
        raise ValueError("a workload needs at least 20 publications")
    if retry_rungs < 3:
        raise ValueError("flaky events fail up to twice: the ladder needs at least 3 rungs")
    faults = {kind: count for kind, count in (faults or {}).items() if count > 0}
    check_faults(total, faults)
    rng = random.Random(seed)
    duplicates = round(total * DUPLICATE_SHARE)
    unique = total - duplicates
    slow = faults.get(Kind.SLOW_DUPLICATE, 0)
    normal = unique - sum(faults.values())
    kinds: list[Kind] = []
    for kind, share in MIX.items():
        kinds.extend([kind] * max(1, round(normal * share)))
    kinds = kinds[:normal]
    kinds.extend([Kind.APPLIED] * (normal - len(kinds)))
    for kind, count in faults.items():
        kinds.extend([kind] * count)
    rng.shuffle(kinds)
    turns: Counter[Kind] = Counter()
    events: list[PlannedEvent] = []
    for n, kind in enumerate(kinds):
        events.append(_event(kind, f"k{n:06d}", rng, turns[kind], oversized=oversized))
        turns[kind] += 1
    events = _collide(events, rng)
    order: list[tuple[float, Publication]] = [
        (float(n + (10 * total if event.kind is Kind.ID_CONFLICT else 0)), Publication(event, 0))
        for n, event in enumerate(events)
    ]
    # A slow event's duplicate right behind it, while its first copy is still in the handler.
    order += [
        (n + 0.25, Publication(event, 1))
        for n, event in enumerate(events)
        if event.kind is Kind.SLOW_DUPLICATE
    ]
    # Any other duplicate follows its original by up to 200 publications (a producer's retry).
    eligible = [n for n, event in enumerate(events) if event.kind.republished]
    for n in rng.sample(eligible, duplicates - slow):
        order.append((n + rng.randint(1, 200) + 0.5, Publication(events[n], 1)))
    order.sort(key=lambda item: item[0])
    return Workload(tuple(events), tuple(publication for _, publication in order))


def gathered(workload: Workload, kinds: Collection[Kind], start: float, end: float) -> Workload:
    """The same publications, those of ``kinds`` (first copies and duplicates, in their order)
    moved evenly into the stretch between the shares ``start`` and ``end`` of the stream: one
    queue's trouble in a stretch of its own, the stream before it clean of it."""
    moved = [p for p in workload.publications if p.event.kind in kinds]
    rest = [p for p in workload.publications if p.event.kind not in kinds]
    if not moved:
        return workload
    first, last = start * len(rest), end * len(rest)
    order = [(float(n), publication) for n, publication in enumerate(rest)]
    order += [
        (first + (n + 0.5) * (last - first) / len(moved), publication)
        for n, publication in enumerate(moved)
    ]
    order.sort(key=lambda item: item[0])
    return Workload(workload.events, tuple(publication for _, publication in order))
