"""What a scenario publishes, and what must become of each message.

A workload is a list of unique events of known kinds, plus republished duplicates (the same body
and event id published again, as a producer retry does), in publishing order. Every publication
has a message id of its own (``<key>.<copy>``), so each copy that ends in the dead-letter queue can
be told apart: a dead-lettered event that was published twice is expected there twice.

================  ==================================================  =========================
kind              message                                             must end as
================  ==================================================  =========================
applied           ``test.behave*`` with a unique key                  one receipt, one effect
restock           ``inventory.restock`` of one of a few SKUs          one receipt, one movement
flaky             ``test.behave*``, ``fail_transient`` 1 or 2         retried, then applied
permanent         ``test.behave*``, ``permanent``                     dead: permanent_failure
bug               ``test.behave``, ``bug`` (an unclassified error)    dead: permanent_failure
not_json          a body that is not JSON                             dead (poison): not_json
invalid_envelope  an envelope whose ``type`` is a number              dead: invalid_envelope
unknown_type      an envelope of a type no handler has                dead: unknown_type
invalid_payload   ``test.behave`` with a payload its model refuses    dead: invalid_payload
================  ==================================================  =========================

``test.behave*`` is ``test.behave`` or, for half of them at random, its batch form
``test.behave_many``: the batch handler path must keep every promise too.
"""

from __future__ import annotations

import enum
import json
import random
import uuid
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime

from consumer.publish import envelope_body

BEHAVE = "test.behave"
BEHAVE_MANY = "test.behave_many"
RESTOCK = "inventory.restock"
SKUS = tuple(f"CHAOS-{n}" for n in range(8))
DUPLICATE_SHARE = 0.10
"""Of all publications, the share that republishes an event already published."""


class Kind(enum.Enum):
    APPLIED = "applied"
    RESTOCK = "restock"
    FLAKY = "flaky"
    PERMANENT = "permanent"
    BUG = "bug"
    NOT_JSON = "not_json"
    INVALID_ENVELOPE = "invalid_envelope"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_PAYLOAD = "invalid_payload"

    @property
    def applies(self) -> bool:
        """Its effect must be applied exactly once."""
        return self in (Kind.APPLIED, Kind.RESTOCK, Kind.FLAKY)

    @property
    def poison(self) -> bool:
        return self in (
            Kind.NOT_JSON,
            Kind.INVALID_ENVELOPE,
            Kind.UNKNOWN_TYPE,
            Kind.INVALID_PAYLOAD,
        )

    @property
    def dead_reason(self) -> str | None:
        """The reason ``dlq list`` must give for each dead copy; None for kinds that apply."""
        if self.applies:
            return None
        if self.poison:
            return self.value
        return "permanent_failure"


# Shares of the unique events; the duplicates come on top (DUPLICATE_SHARE of all publications).
MIX: Mapping[Kind, float] = {
    Kind.APPLIED: 0.60,
    Kind.RESTOCK: 0.10,
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
    """The publication a message id (of any attempt) belongs to."""
    return message_id.split("~", 1)[0]


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
            {event.event_id: event for event in self.events if event.event_id is not None},
        )
        object.__setattr__(self, "by_message_id", {p.message_id: p for p in self.publications})

    def of_kind(self, *kinds: Kind) -> Iterator[PlannedEvent]:
        return (event for event in self.events if event.kind in kinds)

    @property
    def to_apply(self) -> int:
        return sum(1 for event in self.events if event.kind.applies)

    def publications_of(self, event: PlannedEvent) -> list[Publication]:
        return [
            publication
            for copy in (0, 1)
            if (publication := self.by_message_id.get(f"{event.key}.{copy}")) is not None
        ]

    def restocked(self) -> dict[str, int]:
        """What ``stock.available`` must be per SKU once every restock is applied once."""
        totals: dict[str, int] = {}
        for event in self.of_kind(Kind.RESTOCK):
            assert event.sku is not None
            totals[event.sku] = totals.get(event.sku, 0) + event.qty
        return totals


def _occurred_at() -> str:
    return datetime.now(UTC).isoformat()


def _event(kind: Kind, key: str, rng: random.Random) -> PlannedEvent:
    event_id = uuid.UUID(int=rng.getrandbits(128), version=4)
    if kind is Kind.RESTOCK:
        sku, qty = rng.choice(SKUS), rng.randint(1, 5)
        body = envelope_body(RESTOCK, {"sku": sku, "qty": qty}, event_id=event_id)
        return PlannedEvent(key, kind, event_id, RESTOCK, body, sku, qty)
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
        body = envelope_body("chaos.unknown", {"key": key}, event_id=event_id)
        return PlannedEvent(key, kind, event_id, BEHAVE, body)
    payload: dict[str, object] = {"key": key}
    event_type = BEHAVE
    if kind in (Kind.APPLIED, Kind.FLAKY, Kind.PERMANENT):
        event_type = rng.choice((BEHAVE, BEHAVE_MANY))
    if kind is Kind.FLAKY:
        payload["fail_transient"] = rng.choice((1, 2))
    elif kind is Kind.PERMANENT:
        payload["permanent"] = True
    elif kind is Kind.BUG:
        payload["bug"] = True
    elif kind is Kind.INVALID_PAYLOAD:
        payload["fail_transient"] = "twice"
    return PlannedEvent(
        key, kind, event_id, event_type, envelope_body(event_type, payload, event_id=event_id)
    )


def plan_workload(total: int, *, seed: int, retry_rungs: int = 3) -> Workload:
    """``total`` publications: unique events in the proportions of :data:`MIX`, then
    :data:`DUPLICATE_SHARE` of ``total`` republished, each a little after its first copy.

    ``fail_transient`` stays below ``retry_rungs`` so that flaky events end up applied.
    """
    if total < 20:
        raise ValueError("a workload needs at least 20 publications")
    if retry_rungs < 3:
        raise ValueError("flaky events fail up to twice: the ladder needs at least 3 rungs")
    rng = random.Random(seed)
    duplicates = round(total * DUPLICATE_SHARE)
    unique = total - duplicates
    kinds: list[Kind] = []
    for kind, share in MIX.items():
        kinds.extend([kind] * max(1, round(unique * share)))
    kinds = kinds[:unique]
    kinds.extend([Kind.APPLIED] * (unique - len(kinds)))
    rng.shuffle(kinds)
    events = tuple(_event(kind, f"k{n:06d}", rng) for n, kind in enumerate(kinds))
    # A duplicate follows its original by up to 200 publications (a producer's retry).
    order: list[tuple[float, Publication]] = [
        (float(n), Publication(event, 0)) for n, event in enumerate(events)
    ]
    for n in rng.sample(range(unique), duplicates):
        order.append((n + rng.randint(1, 200) + 0.5, Publication(events[n], 1)))
    order.sort(key=lambda item: item[0])
    return Workload(events, tuple(publication for _, publication in order))
