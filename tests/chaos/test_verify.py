"""The chaos checks themselves, on made-up end states: each invariant catches what it is for."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections import Counter
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from consumer.amqp.field_table import UNREADABLE_KEY
from consumer.errors import Poison, PoisonReason
from consumer.outbox import follow_up_id
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser
from tests.chaos.hostile import (
    FORGED_ATTEMPT,
    FORGED_DEAD,
    FORGED_REASON,
    FORGED_ROUTING_KEY,
    FORGED_TIME,
    KEPT_HEADER,
    READ_TAIL,
    SAFE_ONCE_READ,
    Wire,
)
from tests.chaos.observe import DeadCopy, EndState, OutboxRecord
from tests.chaos.producer import Attempt, PublishLog
from tests.chaos.report import RunReport, ScenarioResult
from tests.chaos.resources import cpu_used, memory_budget, parse_cpu_seconds, parse_memory
from tests.chaos.stranded import Stranding
from tests.chaos.verify import (
    Figures,
    Resources,
    Throughput,
    Verdict,
    by_queue,
    check,
    check_resources,
    excuse_losses,
)
from tests.chaos.workload import (
    DUPLICATE_SHARE,
    HANDLER_FAULTS,
    HOSTILE,
    MIX,
    SEED_STOCK,
    Kind,
    PlannedEvent,
    Workload,
    combine,
    gathered,
    plan_block,
    plan_workload,
)

EVERY_FAULT = {
    Kind.SWALLOW: 10,
    Kind.BLOCK: 2,
    Kind.CRASH: 2,
    Kind.KILL_CONNECTION: 3,
    Kind.ODD: 5,
    Kind.ODD_POISON: 5,
    Kind.SLOW_DUPLICATE: 4,
}
EVERY_HOSTILE = {
    Kind.HEADERS_TOO_DEEP: 4,
    Kind.TOO_COMPLEX: 4,
    Kind.HOSTILE_HEADERS: 8,
    Kind.HOSTILE_HEADERS_PERMANENT: 8,
    Kind.FORGED_HEADERS: 4,
}


def perfect(workload: Workload) -> tuple[PublishLog, EndState]:
    """What a faultless run leaves: every publication confirmed, everything where it belongs."""
    log = PublishLog()
    state = EndState()
    for publication in workload.publications:
        log.attempts[publication.message_id] = Attempt.CONFIRMED
        event = publication.event
        if event.kind.applies:
            continue
        state.dead.append(dead_copy(publication.message_id, event))
        state.listed.append(
            {
                "id": str(event.event_id or publication.message_id),
                "type": event.routing_key,
                "reason": event.kind.dead_reason,
                "dead_lettered_by": "broker" if event.kind.by_broker else "service",
                "attempts": None if event.kind.by_broker else 0,
                "dead_lettered_at": datetime.now(UTC).isoformat(),
            }
        )
    for event in workload.events:
        if not event.kind.applies:
            continue
        assert event.event_id is not None
        state.receipts[event.event_id] = 1
        rows(state, event)[event.event_id] = 1
    state.stock = workload.stock()
    return log, state


def dead_copy(message_id: str, event: PlannedEvent) -> DeadCopy:
    """The dead copy the service and the broker leave of ``event``, as the runner reads it."""
    if event.kind is Kind.HEADERS_TOO_LARGE:  # the runner's decoder refuses its headers too
        return DeadCopy(message_id, None, None, header_names=frozenset({UNREADABLE_KEY}))
    if event.kind.by_broker:  # the original, nacked: the producer's forged headers and x-death
        return DeadCopy(
            message_id,
            FORGED_REASON,
            "rejected",
            routing_key=FORGED_ROUTING_KEY,
            attempt=FORGED_ATTEMPT,
            header_names=frozenset({*FORGED_DEAD, "x-death", "x-first-death-reason"}),
            dead_lettered_at=FORGED_TIME,
        )
    names = {"consumer-dead-reason", "consumer-attempt", "consumer-original-routing-key"}
    if event.wire in KEPT_HEADER:
        names.add(KEPT_HEADER[event.wire])
    return DeadCopy(
        message_id + (READ_TAIL if event.wire is Wire.NOT_UTF8_MESSAGE_ID else ""),
        event.kind.header_reason,
        None,
        error_class=event.kind.error_class,
        routing_key=event.routing_key,
        attempt=0,
        header_names=frozenset(names),
        dead_lettered_at=datetime.now(UTC).isoformat(),
    )


def rows(state: EndState, event: PlannedEvent) -> Counter[uuid.UUID]:
    """The end state's rows of the table that holds ``event``'s effect."""
    if event.kind in (Kind.RESTOCK, Kind.RESERVE):
        return state.movements
    if event.kind is Kind.NOTIFY:
        return state.notifications
    return state.effects


def dead_copy_of(state: EndState, event: PlannedEvent) -> int:
    """The index of ``event``'s first dead copy."""
    return next(i for i, c in enumerate(state.dead) if (c.message_id or "") == f"{event.key}.0")


def test_the_workload_mixes_every_kind_and_ten_percent_duplicates() -> None:
    workload = plan_workload(2_000, seed=3)

    assert len(workload.publications) == 2_000
    assert sum(p.copy for p in workload.publications) == round(2_000 * DUPLICATE_SHARE)
    kinds = Counter(event.kind for event in workload.events)
    assert set(kinds) == set(MIX)
    assert not set(kinds) & HANDLER_FAULTS
    assert len({p.message_id for p in workload.publications}) == 2_000
    for event in workload.of_kind(Kind.FLAKY):
        assert b'"fail_transient":1' in event.body or b'"fail_transient":2' in event.body
    # A duplicate comes after its first copy.
    position = {p.message_id: n for n, p in enumerate(workload.publications)}
    for publication in workload.publications:
        if publication.copy:
            assert position[publication.message_id] > position[f"{publication.event.key}.0"]


def test_a_faultless_end_state_passes_every_check() -> None:
    workload = plan_workload(500, seed=1)
    log, state = perfect(workload)

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert verdict.ok, verdict.violations
    assert verdict.figures.lost == verdict.figures.duplicated == verdict.figures.extra_dead == 0
    assert verdict.figures.applied == workload.to_apply
    assert verdict.figures.dead_lettered == verdict.figures.dead_expected


def test_a_lost_effect_a_second_effect_and_a_lost_dead_letter_are_each_caught() -> None:
    workload = plan_workload(500, seed=1)
    log, state = perfect(workload)
    first, second = (e.event_id for e in list(workload.of_kind(Kind.APPLIED))[:2])
    assert first is not None
    assert second is not None
    del state.effects[first]
    del state.receipts[first]
    state.effects[second] = 2
    state.dead.pop()
    state.listed.pop()

    verdict = check(workload, log, state, extra_dead_allowed=True)

    assert verdict.figures.lost == 2
    assert verdict.figures.duplicated == 1
    assert any(v.startswith("LOST: events that must apply") for v in verdict.violations)
    assert any(v.startswith("LOST: confirmed dead-bound") for v in verdict.violations)
    assert any(v.startswith("DUPLICATED effects") for v in verdict.violations)


def test_an_extra_dead_copy_is_allowed_only_where_a_fault_cuts_the_broker_link() -> None:
    workload = plan_workload(500, seed=1)
    log, state = perfect(workload)
    state.dead.append(state.dead[0])
    state.listed.append(state.listed[0])

    assert check(workload, log, state, extra_dead_allowed=True).ok
    verdict = check(workload, log, state, extra_dead_allowed=False)
    assert not verdict.ok
    assert verdict.figures.extra_dead == 1


def test_an_unconfirmed_resend_may_be_dead_once_but_not_twice() -> None:
    workload = plan_workload(500, seed=1)
    log, state = perfect(workload)
    poison = next(p for p in workload.publications if p.event.kind.poison)
    log.attempts[f"{poison.message_id}~1"] = Attempt.UNCERTAIN
    resent = DeadCopy(f"{poison.message_id}~1", poison.event.kind.header_reason, None)
    state.dead.append(resent)
    state.listed.append(state.listed[0] | {"id": str(poison.event.event_id or resent.message_id)})

    assert check(workload, log, state, extra_dead_allowed=False).ok
    state.dead.append(resent)
    state.listed.append(state.listed[-1])
    assert not check(workload, log, state, extra_dead_allowed=False).ok


def test_a_dead_letter_with_the_wrong_reason_or_a_valid_event_in_the_dlq_fails() -> None:
    workload = plan_workload(500, seed=1)
    log, state = perfect(workload)
    permanent = next(i for i, c in enumerate(state.dead) if c.reason == "permanent_failure")
    state.dead[permanent] = DeadCopy(state.dead[permanent].message_id, None, "delivery_limit")
    flaky = next(workload.of_kind(Kind.FLAKY))
    assert flaky.event_id is not None
    state.dead.append(DeadCopy(f"{flaky.key}.0", None, "expired"))
    state.listed.append({"id": str(flaky.event_id), "reason": "expired"})

    verdict = check(workload, log, state, extra_dead_allowed=True)

    assert any("wrong reason headers" in v for v in verdict.violations)
    assert any("must apply found in the DLQ" in v for v in verdict.violations)
    assert any("dlq list reasons" in v for v in verdict.violations)


def test_leftovers_stock_and_strangers_fail() -> None:
    workload = plan_workload(500, seed=1)
    log, state = perfect(workload)
    state.leftovers = {"x.work": 3}
    sku = next(iter(state.stock))
    state.stock[sku] += 1
    state.effects[uuid.uuid4()] = 1

    verdict = check(workload, log, state, extra_dead_allowed=True)

    assert any("left in the work" in v for v in verdict.violations)
    assert any("stock" in v for v in verdict.violations)
    assert any("never published" in v for v in verdict.violations)


def test_handler_faults_are_mixed_in_by_number_and_slow_ones_published_back_to_back() -> None:
    workload = plan_workload(2_000, seed=3, faults=EVERY_FAULT)

    assert len(workload.publications) == 2_000
    assert sum(p.copy for p in workload.publications) == round(2_000 * DUPLICATE_SHARE)
    kinds = Counter(event.kind for event in workload.events)
    for kind, count in EVERY_FAULT.items():
        assert kinds[kind] == count
    position = {p.message_id: n for n, p in enumerate(workload.publications)}
    copies = Counter(p.event.kind for p in workload.publications if p.copy)
    # A slow event's duplicate comes right after its first copy; an event that ends the process
    # or its connection is published once.
    assert copies[Kind.SLOW_DUPLICATE] == EVERY_FAULT[Kind.SLOW_DUPLICATE]
    for event in workload.of_kind(Kind.SLOW_DUPLICATE):
        assert position[f"{event.key}.1"] == position[f"{event.key}.0"] + 1
    assert not copies[Kind.BLOCK] + copies[Kind.CRASH] + copies[Kind.KILL_CONNECTION]


def test_a_faultless_end_state_with_every_handler_fault_passes_every_check() -> None:
    workload = plan_workload(2_000, seed=2, faults=EVERY_FAULT)
    log, state = perfect(workload)

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert verdict.ok, verdict.violations
    assert verdict.figures.applied == workload.to_apply
    assert verdict.figures.innocent_dead == 0
    assert verdict.figures.dead_lettered == verdict.figures.dead_expected


def test_innocent_dead_letters_are_counted_and_violate() -> None:
    # Given batch-mates of a crashing event dragged to the delivery limit by its crash loop
    workload = plan_workload(2_000, seed=2, faults=EVERY_FAULT)
    log, state = perfect(workload)
    innocents = list(workload.of_kind(Kind.APPLIED, Kind.RESERVE))[:3]
    for event in innocents:
        assert event.event_id is not None
        del rows(state, event)[event.event_id]
        del state.receipts[event.event_id]
        state.dead.append(DeadCopy(f"{event.key}.0", None, "delivery_limit", "x.work:x1"))
        state.listed.append({"id": str(event.event_id), "reason": "delivery_limit"})

    verdict = check(workload, log, state, extra_dead_allowed=True)

    assert verdict.figures.innocent_dead == 3
    assert verdict.figures.lost == 3
    assert any(v.startswith("INNOCENT: events that must apply") for v in verdict.violations)


def test_a_handler_fault_needs_its_own_reason_and_error_class() -> None:
    workload = plan_workload(2_000, seed=2, faults=EVERY_FAULT)
    log, state = perfect(workload)
    swallow = next(workload.of_kind(Kind.SWALLOW))
    block = next(workload.of_kind(Kind.BLOCK))
    odd = next(workload.of_kind(Kind.ODD_POISON))
    # A module-qualified class name is the same class.
    index = dead_copy_of(state, swallow)
    state.dead[index] = DeadCopy(
        f"{swallow.key}.0",
        "permanent_failure",
        None,
        error_class="consumer.x.SwallowedDatabaseError",
    )
    assert check(workload, log, state, extra_dead_allowed=False).ok

    # The aborted transaction's next statement named instead of the swallowed error
    state.dead[index] = DeadCopy(
        f"{swallow.key}.0", "permanent_failure", None, error_class="InFailedSQLTransactionError"
    )
    # A crash loop ended by the broker's delivery limit instead of the service's hard limit
    state.dead[dead_copy_of(state, block)] = DeadCopy(
        f"{block.key}.0", None, "delivery_limit", "x.work:delivery_limit x1"
    )
    # An odd payload nacked as ordinary poison instead of dead-lettered with headers
    state.dead[dead_copy_of(state, odd)] = DeadCopy(f"{odd.key}.0", None, "rejected")

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert any(
        v.startswith("dead copies with the wrong error class: 1") for v in verdict.violations
    )
    assert any(
        v.startswith("dead copies with the wrong reason headers: 2") for v in verdict.violations
    )


def test_a_swallowed_error_acked_without_a_dead_letter_is_lost() -> None:
    # Given a swallowing event the service acked (COMMIT answered ROLLBACK): no effect, no copy
    workload = plan_workload(2_000, seed=2, faults=EVERY_FAULT)
    log, state = perfect(workload)
    swallow = next(
        e for e in workload.of_kind(Kind.SWALLOW) if len(workload.publications_of(e)) == 1
    )
    del state.dead[dead_copy_of(state, swallow)]
    state.listed = [row for row in state.listed if row["id"] != str(swallow.event_id)]

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert verdict.figures.lost == 1
    assert any(v.startswith("LOST: confirmed dead-bound") for v in verdict.violations)


def test_reserves_and_notifications_are_counted_exactly() -> None:
    workload = plan_workload(2_000, seed=2)
    log, state = perfect(workload)
    reserve = next(workload.of_kind(Kind.RESERVE))
    notify = next(workload.of_kind(Kind.NOTIFY))
    assert reserve.event_id is not None
    assert notify.event_id is not None
    assert reserve.sku is not None
    # A reserve applied twice: a second movement, and its stock taken twice
    state.movements[reserve.event_id] = 2
    state.stock[reserve.sku] -= reserve.qty
    # A notification applied twice
    state.notifications[notify.event_id] = 2

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert verdict.figures.duplicated == 2
    assert any(v.startswith("DUPLICATED effects: 2") for v in verdict.violations)
    assert any(v.startswith("stock that is not the seed") for v in verdict.violations)


def test_hostile_messages_are_mixed_in_by_number_each_header_in_turn() -> None:
    workload = plan_workload(600, seed=4, faults=EVERY_HOSTILE)

    kinds = Counter(event.kind for event in workload.events)
    assert {kind: kinds[kind] for kind in EVERY_HOSTILE} == EVERY_HOSTILE
    assert not {kind for kind in HOSTILE - set(EVERY_HOSTILE) if kinds[kind]}
    for kind in (Kind.HOSTILE_HEADERS, Kind.HOSTILE_HEADERS_PERMANENT):
        wires = Counter(event.wire for event in workload.of_kind(kind))
        assert wires == dict.fromkeys(SAFE_ONCE_READ, 2), kind
    assert {e.wire for e in workload.of_kind(Kind.HEADERS_TOO_DEEP)} == {Wire.DEEP_HEADERS}
    assert {e.wire for e in workload.of_kind(Kind.FORGED_HEADERS)} == {Wire.FORGED}
    assert all(
        e.wire is None for e in workload.events if e.kind not in HOSTILE - {Kind.TOO_COMPLEX}
    )


def test_hostile_bodies_are_what_the_service_judges_them_by() -> None:
    # Given the service's parser at its defaults
    parser = EnvelopeParser(EnvelopeLimits())
    workload = plan_workload(600, seed=4, faults=EVERY_HOSTILE)

    # Then a too_complex body is within the size limit and poison only for its containers
    for event in workload.of_kind(Kind.TOO_COMPLEX):
        assert len(event.body) < EnvelopeLimits().max_bytes
        with pytest.raises(Poison) as judged:
            parser.decode(event.body)
        assert judged.value.reason is PoisonReason.TOO_COMPLEX
    # And every other hostile message's body is a valid envelope: only its wire is hostile
    for event in workload.of_kind(*(HOSTILE - {Kind.TOO_COMPLEX})):
        assert parser.parse(event.body).event_id == event.event_id


def test_a_faultless_end_state_with_every_hostile_message_passes_every_check() -> None:
    workload = plan_workload(600, seed=4, faults=EVERY_HOSTILE)
    log, state = perfect(workload)

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert verdict.ok, verdict.violations
    assert verdict.figures.applied == workload.to_apply
    assert verdict.figures.dead_lettered == verdict.figures.dead_expected
    # A message id that was not UTF-8 came back with replacement characters, and counted
    assert any(READ_TAIL in (copy.message_id or "") for copy in state.dead)


def test_forged_headers_left_on_a_dead_letter_are_caught() -> None:
    # Given the service trusting a producer's consumer-* headers on a forged event
    workload = plan_workload(600, seed=4, faults=EVERY_HOSTILE)
    log, state = perfect(workload)
    forged = next(workload.of_kind(Kind.FORGED_HEADERS))
    index = dead_copy_of(state, forged)
    state.dead[index] = DeadCopy(
        state.dead[index].message_id,
        "all is well",
        None,
        error_class="Forged",
        routing_key="payments.refund",
        attempt=0,
    )

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert any(
        v.startswith("dead copies with the wrong reason headers: 1") for v in verdict.violations
    )
    assert any(
        v.startswith("dead copies without the service's own headers: 1") and "payments.refund" in v
        for v in verdict.violations
    )


def test_a_producers_attempt_count_or_a_header_lost_on_the_dead_letter_is_caught() -> None:
    workload = plan_workload(600, seed=4, faults=EVERY_HOSTILE)
    log, state = perfect(workload)
    permanent = list(workload.of_kind(Kind.HOSTILE_HEADERS_PERMANENT))
    digits = next(e for e in permanent if e.wire is Wire.LONG_ATTEMPT)
    double = next(e for e in permanent if e.wire is Wire.HUGE_DOUBLE)
    # The producer's 5,000 digits taken for the attempt count (capped by the service)
    index = dead_copy_of(state, digits)
    state.dead[index] = dataclasses.replace(state.dead[index], attempt=10_000)
    # The header that had to be made safe dropped instead
    index = dead_copy_of(state, double)
    state.dead[index] = dataclasses.replace(state.dead[index], header_names=frozenset())

    verdict = check(workload, log, state, extra_dead_allowed=False)

    [violation] = [v for v in verdict.violations if "service's own headers" in v]
    assert violation.startswith("dead copies without the service's own headers: 2")
    assert "attempt '10000'" in violation
    assert "'big' header dropped" in violation


def test_hostile_messages_ending_elsewhere_than_promised_are_caught() -> None:
    # Given the hostile messages of a service that mishandles each in its own way
    workload = plan_workload(600, seed=4, faults=EVERY_HOSTILE)
    log, state = perfect(workload)
    deep = next(workload.of_kind(Kind.HEADERS_TOO_DEEP))
    flaky = next(
        e
        for e in workload.of_kind(Kind.HOSTILE_HEADERS)
        if e.wire is Wire.LONG_ATTEMPT and len(workload.publications_of(e)) == 1
    )
    renamed = next(
        e
        for e in workload.of_kind(Kind.HOSTILE_HEADERS_PERMANENT)
        if e.wire is Wire.NOT_UTF8_MESSAGE_ID and len(workload.publications_of(e)) == 1
    )
    assert flaky.event_id is not None
    # A deep-headers event the broker dead-lettered after the connection broke five times
    index = dead_copy_of(state, deep)
    state.dead[index] = DeadCopy(f"{deep.key}.0", None, "delivery_limit")
    state.listed = [
        row | {"reason": "delivery_limit"} if row["id"] == str(deep.event_id) else row
        for row in state.listed
    ]
    # A flaky event whose forged attempt count was believed: dead at its first failure
    del state.effects[flaky.event_id]
    del state.receipts[flaky.event_id]
    state.dead.append(DeadCopy(f"{flaky.key}.0", "retries_exhausted", None))
    state.listed.append({"id": str(flaky.event_id), "reason": "retries_exhausted"})
    # A message id the service could not read, dropped from the dead copy
    index = next(
        i for i, c in enumerate(state.dead) if (c.message_id or "").startswith(f"{renamed.key}.0")
    )
    state.dead[index] = dataclasses.replace(state.dead[index], message_id=None)

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert verdict.figures.lost == 2  # the flaky event, and the dead copy no id finds
    assert verdict.figures.innocent_dead == 1
    assert any(
        v.startswith("dead copies with the wrong reason headers: 1") for v in verdict.violations
    )
    assert any(
        v.startswith("dlq list reasons that are not the expected ones: 2")
        for v in verdict.violations
    )
    assert any(v.startswith("INNOCENT: events that must apply") for v in verdict.violations)
    assert any(
        v.startswith("dead copies of messages never published: 1") for v in verdict.violations
    )


def test_excused_losses_become_notes_and_stay_counted() -> None:
    # Given a verdict with losses, a stock short of them, a count above them, and a duplicate
    verdict = Verdict(
        Figures(lost=2),
        violations=[
            "LOST: events that must apply with no effect: 2 (k1, k2)",
            "stock that is not the seed + restocks - reserves: 1 (A: 1 != 2)",
            "metrics: processed 10 != 8 effects",
            "DUPLICATED effects: 1 (k3x2)",
        ],
    )

    # When losses are excused (asynchronous replication)
    excuse_losses(verdict, "asynchronous replication")

    # Then only the duplicate is still a violation; the losses are notes, and counted
    assert verdict.violations == ["DUPLICATED effects: 1 (k3x2)"]
    assert len(verdict.notes) == 3
    assert all(note.startswith("asynchronous replication: ") for note in verdict.notes)
    assert verdict.figures.lost == 2


EXPIRY_AGE = timedelta(seconds=20)
"""``receipt-pruning``'s: a 30s retention less a 10s margin."""


def expired_copy(message_id: str, event: PlannedEvent, age: timedelta) -> DeadCopy:
    """A copy of ``event`` the service dead-lettered ``expired`` when the event was ``age`` old."""
    occurred_at = datetime.fromisoformat(json.loads(event.body)["occurred_at"])
    return DeadCopy(
        message_id,
        "expired",
        None,
        error_class="EventExpired",
        routing_key=event.routing_key,
        attempt=0,
        header_names=frozenset({"consumer-dead-reason", "consumer-dead-lettered-at"}),
        dead_lettered_at=(occurred_at + age).isoformat(),
    )


def test_an_expired_late_copy_of_an_applied_event_is_counted_only_where_expected() -> None:
    workload = plan_workload(500, seed=5)
    log, state = perfect(workload)
    duplicate = next(p for p in workload.publications if p.copy and p.event.kind is Kind.APPLIED)
    state.dead.append(expired_copy(duplicate.message_id, duplicate.event, timedelta(seconds=25)))
    state.listed.append({"id": str(duplicate.event.event_id), "reason": "expired"})

    # A scenario with a short receipts window: a note, not a violation
    expected = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)
    assert expected.ok, expected.violations
    assert any("dead-lettered expired: 1" in note for note in expected.notes)
    # Anywhere else: an event that must apply found in the DLQ
    elsewhere = check(workload, log, state, extra_dead_allowed=False)
    assert any("INNOCENT" in violation for violation in elsewhere.violations)

    # And an expired event with no effect is lost even where expiry is expected
    assert duplicate.event.event_id is not None
    rows(state, duplicate.event)[duplicate.event.event_id] = 0
    lost = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)
    assert any("LOST" in violation for violation in lost.violations)


def test_a_copy_dead_lettered_expired_while_young_is_innocent() -> None:
    workload = plan_workload(500, seed=5)
    log, state = perfect(workload)
    duplicate = next(p for p in workload.publications if p.copy and p.event.kind is Kind.APPLIED)
    state.dead.append(expired_copy(duplicate.message_id, duplicate.event, timedelta(seconds=3)))
    state.listed.append({"id": str(duplicate.event.event_id), "reason": "expired"})

    verdict = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)

    assert any("INNOCENT" in violation for violation in verdict.violations), verdict.violations
    assert verdict.figures.innocent_dead == 1


def none_applied_all_expired(age: timedelta | None) -> tuple[Workload, PublishLog, EndState]:
    """The issue's end state: no event that must apply has an effect or a receipt, and every
    copy of each is in the DLQ as ``expired`` (stamped when ``age`` old; None: not stamped)."""
    workload = plan_workload(500, seed=5)
    log, state = perfect(workload)
    for event in workload.events:
        if not event.kind.applies:
            continue
        assert event.event_id is not None
        rows(state, event)[event.event_id] = 0
        del state.receipts[event.event_id]
        for publication in workload.publications_of(event):
            copy = expired_copy(publication.message_id, event, age or timedelta(0))
            state.dead.append(
                copy if age is not None else dataclasses.replace(copy, dead_lettered_at=None)
            )
            state.listed.append({"id": str(event.event_id), "reason": "expired"})
    # What the stock is with none of them applied.
    state.stock = dict.fromkeys(workload.stock(), SEED_STOCK)
    return workload, log, state


@pytest.mark.parametrize(
    "age",
    [None, timedelta(0), timedelta(seconds=19)],
    ids=["unstamped", "dead-lettered-at-once", "just-inside-the-window"],
)
def test_events_dead_lettered_expired_before_their_age_made_it_inevitable_are_lost(
    age: timedelta | None,
) -> None:
    workload, log, state = none_applied_all_expired(age)
    assert workload.to_apply == 370

    verdict = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)

    assert verdict.figures.lost == 370
    assert verdict.figures.applied == 0
    assert any(v.startswith("LOST: events that must apply") for v in verdict.violations)


def test_a_dead_lettered_at_later_than_the_queue_was_read_excuses_nothing() -> None:
    workload, log, state = none_applied_all_expired(timedelta(seconds=25))
    occurred_at = min(
        datetime.fromisoformat(json.loads(event.body)["occurred_at"])
        for event in workload.events
        if event.kind.applies
    )
    state.dead_read_at = occurred_at + timedelta(seconds=10)

    verdict = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)

    assert verdict.figures.lost == 370


def test_an_event_whose_one_dead_copy_expired_on_the_ladder_is_accounted_for() -> None:
    # Its duplicate was acked as a copy of the first in their batch; the first went on along the
    # retry ladder and was refused as expired there, old enough: in the DLQ, not lost
    workload = plan_workload(500, seed=5)
    log, state = perfect(workload)
    duplicate = next(p for p in workload.publications if p.copy and p.event.kind is Kind.APPLIED)
    event = duplicate.event
    assert event.event_id is not None
    rows(state, event)[event.event_id] = 0
    del state.receipts[event.event_id]
    off_the_ladder = dataclasses.replace(
        expired_copy(f"{event.key}.0", event, timedelta(seconds=28)), attempt=2
    )
    state.dead.append(off_the_ladder)
    state.listed.append({"id": str(event.event_id), "reason": "expired"})
    state.stock = workload.stock()

    verdict = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)

    assert verdict.ok, verdict.violations
    assert verdict.figures.lost == 0
    # A first delivery's copy (never retried) explains no other copy: that one is lost
    state.dead[-1] = dataclasses.replace(off_the_ladder, attempt=0)
    lost = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)
    assert lost.figures.lost == 1


@pytest.mark.parametrize(("age", "ok"), [(timedelta(seconds=25), True), (timedelta(0), False)])
def test_a_dead_bound_event_may_be_dead_lettered_expired_only_when_old_enough(
    age: timedelta, ok: bool
) -> None:
    # Its age is judged before its type: an old event of an unknown type is refused as expired
    workload = plan_workload(500, seed=5)
    log, state = perfect(workload)
    index, copy = next(
        (i, c)
        for i, c in enumerate(state.dead)
        if workload.by_message_id[c.message_id or ""].event.kind is Kind.UNKNOWN_TYPE
    )
    event = workload.by_message_id[copy.message_id or ""].event
    state.dead[index] = expired_copy(copy.message_id or "", event, age)
    state.listed[index] = {"id": str(event.event_id), "reason": "expired"}

    verdict = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)

    assert verdict.ok is ok, verdict.violations
    if not ok:
        assert any("wrong reason" in violation for violation in verdict.violations)


def test_events_whose_age_made_every_copys_expiry_inevitable_are_accounted_for() -> None:
    workload, log, state = none_applied_all_expired(timedelta(seconds=25))

    verdict = check(workload, log, state, extra_dead_allowed=False, expired_copies=EXPIRY_AGE)

    assert verdict.figures.lost == 0, verdict.violations
    assert verdict.ok, verdict.violations
    assert any("(370 events with no copy applied)" in note for note in verdict.notes)


def test_a_stranding_the_runbooks_step_recovered_is_reported_with_its_raw_count() -> None:
    # Given two queues that held messages back once quiet, and the step forwarding one's only
    stranding = Stranding(
        held={"c.work": 30, "c.retry.400ms": 12}, left={"c.work": 2}, steps={"c.work": "ok"}
    )
    result = ScenarioResult("cluster-leader-kill", "leader kill", 1)
    result.verdict = Verdict(
        Figures(lost=2, stranded=stranding.stranded, recovered=stranding.recovered)
    )
    report = RunReport("short", "test", datetime.now(UTC), {}, {}, [result])

    # Then the table keeps both: lost after the step, and what was stranded before it
    assert (stranding.stranded, stranding.recovered) == (42, 40)
    assert "| 2 (stranded 42, 40 recovered by the runbook's step) |" in report.table()
    assert [note.split(":")[0] for note in stranding.notes()] == ["c.work", "c.retry.400ms"]
    assert "had 28 forwarded" in stranding.notes()[0]


def test_without_a_stranding_the_lost_cell_is_the_count_alone() -> None:
    result = ScenarioResult("sigkill", "SIGKILL", 1)
    result.verdict = Verdict(Figures(lost=3))

    table = RunReport("short", "test", datetime.now(UTC), {}, {}, [result]).table()

    assert "| 3 | 0 |" in table
    assert "stranded" not in table


# -- issue 29's hostile kinds ---------------------------------------------------------------------

ISSUE_29 = {
    Kind.HEADERS_UNREADABLE: 3,
    Kind.FORGED_DEAD_LETTER: 3,
    Kind.ROUTING_KEY_MISMATCH: 3,
    Kind.ID_CONFLICT: 3,
}
BURST = {Kind.BODY_TOO_LARGE: 2, Kind.HEADERS_TOO_LARGE: 2}


def issue_29_workload() -> Workload:
    """The hostile scenario's shape: a clean block, an attacked one, the stream."""
    return combine(
        plan_block("c", 40, seed=5),
        plan_block("a", 40, seed=6, burst=BURST, oversized=1024),
        plan_workload(600, seed=7, faults={**EVERY_HOSTILE, **ISSUE_29}),
    )


def test_issue_29s_kinds_are_planned_as_the_scenario_sends_them() -> None:
    stream = plan_workload(600, seed=7, faults=ISSUE_29)
    attacked = plan_block("a", 40, seed=6, burst=BURST, oversized=1024)

    # The id collisions reuse an applied event's id and occurred_at under another type, last
    assert [p.event.kind for p in stream.publications[-3:]] == [Kind.ID_CONFLICT] * 3
    assert stream.tail == stream.publications[-3:]
    for collision in stream.of_kind(Kind.ID_CONFLICT):
        victim = stream.by_key[collision.victim or ""]
        assert victim.kind is Kind.APPLIED
        assert collision.event_id == victim.event_id
        assert collision.routing_key != victim.routing_key
        assert json.loads(collision.body)["occurred_at"] == json.loads(victim.body)["occurred_at"]
        assert victim.event_id is not None
        assert stream.listed_event(victim.event_id, victim.routing_key) is victim
        assert stream.listed_event(victim.event_id, collision.routing_key) is collision
    assert set(stream.victims) == {e.event_id for e in stream.of_kind(Kind.ID_CONFLICT)}
    # A routing-key mismatch is a restock under a notification key, outside the stock's sums
    for mismatch in stream.of_kind(Kind.ROUTING_KEY_MISMATCH):
        assert json.loads(mismatch.body)["type"] == "inventory.restock"
        assert mismatch.routing_key == "notification.requested"
    assert stream.stock() == plan_workload(600, seed=7, faults=ISSUE_29).stock()
    # The attacked block: its innocents with the burst spread among them, none first or last
    kinds = [event.kind for event in attacked.events]
    assert kinds.count(Kind.APPLIED) == 40
    assert Counter(kinds) - Counter({Kind.APPLIED: 40}) == BURST
    assert kinds[0] is kinds[-1] is Kind.APPLIED
    assert {e.wire for e in attacked.of_kind(Kind.HEADERS_TOO_LARGE)} == {Wire.FLOOD, Wire.WIDE}
    assert all(len(e.body) > 1024 for e in attacked.of_kind(Kind.BODY_TOO_LARGE))
    assert all(e.key.startswith("a") for e in attacked.events)


def test_a_faultless_end_state_with_issue_29s_kinds_passes_every_check() -> None:
    workload = issue_29_workload()
    log, state = perfect(workload)

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert verdict.ok, verdict.violations
    assert verdict.figures.dead_lettered == verdict.figures.dead_expected


def test_forged_dead_letter_headers_presented_as_the_services_are_caught() -> None:
    workload = issue_29_workload()
    log, state = perfect(workload)
    forged = next(workload.of_kind(Kind.FORGED_DEAD_LETTER))
    oversized = next(workload.of_kind(Kind.BODY_TOO_LARGE))
    # The service's copy of a forged poison letter keeping the producer's reason and time
    index = dead_copy_of(state, forged)
    state.dead[index] = dataclasses.replace(
        state.dead[index], reason="expired", dead_lettered_at="1999-01-01T00:00:00+00:00"
    )
    # and dlq presenting the broker's letter's forged headers as the service's
    row = next(r for r in state.listed if r["id"] == str(oversized.event_id))
    row.update(dead_lettered_by="service", attempts=FORGED_ATTEMPT)

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert any("wrong reason headers: 1" in v for v in verdict.violations)
    assert any("service's own headers: 1" in v and "1999" in v for v in verdict.violations), (
        verdict.violations
    )
    assert any("dlq list reasons" in v and "not the broker" in v for v in verdict.violations)


def test_an_oversized_body_copied_instead_of_nacked_is_caught() -> None:
    workload = issue_29_workload()
    log, state = perfect(workload)
    oversized = next(workload.of_kind(Kind.BODY_TOO_LARGE))
    index = dead_copy_of(state, oversized)
    state.dead[index] = dataclasses.replace(
        state.dead[index], reason="body_too_large", first_death_reason=None
    )

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert any("not the broker's letter" in v for v in verdict.violations)


def test_a_routed_restock_or_a_collision_applied_is_caught() -> None:
    workload = issue_29_workload()
    log, state = perfect(workload)
    mismatch = next(workload.of_kind(Kind.ROUTING_KEY_MISMATCH))
    collision = next(workload.of_kind(Kind.ID_CONFLICT))
    assert mismatch.event_id is not None
    assert collision.event_id is not None
    assert mismatch.sku is not None
    # The restock applied under the notification key, the stock up by its 500
    state.movements[mismatch.event_id] = 1
    state.stock[mismatch.sku] += mismatch.qty
    # The collision applied in place of its victim
    victim = workload.by_key[collision.victim or ""]
    state.notifications[collision.event_id] = 1
    del state.effects[collision.event_id]

    verdict = check(workload, log, state, extra_dead_allowed=False)

    assert any(
        v.startswith("LOST: events that must apply") and victim.key in v for v in verdict.violations
    )
    dead_with_effect = next(v for v in verdict.violations if v.startswith("dead-bound events"))
    assert mismatch.key in dead_with_effect
    assert collision.key in dead_with_effect
    assert any(v.startswith("stock that is not") for v in verdict.violations)


# -- resources ------------------------------------------------------------------------------------

MIB = 1024 * 1024


def measured(
    clean: tuple[float, float], attack: tuple[float, float], peak: int = 100 * MIB
) -> Resources:
    """1,000 innocents each way, in (seconds, CPU seconds)."""
    return Resources(
        budget_bytes=391 * MIB,
        peak_rss_bytes=peak,
        clean=Throughput(1_000, *clean),
        attack=Throughput(1_000, *attack),
    )


def checked(resources: Resources) -> Verdict:
    verdict = Verdict(Figures())
    check_resources(resources, verdict)
    return verdict


def test_rss_over_the_logged_budget_or_no_budget_is_a_violation() -> None:
    assert checked(measured((1, 1), (1.5, 1.5))).ok
    [over] = checked(measured((1, 1), (1, 1), peak=400 * MIB)).violations
    assert over == "memory: peak RSS 400 MiB over the start-up budget 391 MiB"
    unbudgeted = dataclasses.replace(measured((1, 1), (1, 1)), budget_bytes=None)
    assert checked(unbudgeted).violations == [
        "memory: no consumer logged memory_budget_bytes at start-up"
    ]


def test_throughput_under_half_the_clean_runs_is_a_violation_unless_the_machine_starved_it() -> (
    None
):
    # Half as fast exactly: holds
    assert checked(measured((1, 0.8), (2, 1.6))).ok
    # Slower by the clock and per CPU-second (the hostile messages cost the CPU): violated
    [slow] = checked(measured((1, 0.8), (2.5, 2.0))).violations
    assert slow.startswith("throughput: innocents under attack at 0.40")
    # Slower by the clock only, while the consumers got less CPU a second than clean: excused
    starved = checked(measured((1, 0.8), (2.5, 0.9)))
    assert starved.ok
    assert starved.notes[0].startswith("throughput: wall-clock 0.40 of the clean run's")
    # Slower by the clock only, the consumers as busy as clean (not waiting for the broker)
    assert not checked(measured((1, 0.4), (2.5, 1.0))).ok
    assert checked(Resources(budget_bytes=1, peak_rss_bytes=1)).violations == [
        "throughput: the clean and attacked blocks were not measured"
    ]


def test_the_report_shows_the_resources_and_saves_the_ratios(tmp_path: Path) -> None:
    verdict = checked(measured((1, 0.8), (1.25, 1.0)))
    result = ScenarioResult("hostile-producers", "hostile", 2, verdict=verdict)
    report = RunReport("short", "x", datetime.now(UTC), {}, {}, results=[result])

    assert (
        "- resources: peak RSS 100 MiB (budget 391 MiB); innocents clean: 1000 in 1.00s = "
        "1000/s, 0.80 consumer CPU-s = 1250/CPU-s; innocents among header floods: 1000 in "
        "1.25s = 800/s, 1.00 consumer CPU-s = 1000/CPU-s; among header floods / clean: 0.80 "
        "wall-clock, 0.80 CPU (floor)"
    ) in report.markdown()
    saved = json.loads(report.save(tmp_path).with_suffix(".json").read_text())
    figures = saved["results"][0]["resources"]
    assert figures["wall_ratio"] == pytest.approx(0.8)
    assert figures["peak_rss_bytes"] == 100 * MIB


def test_proc_readings_are_parsed() -> None:
    stat = "4242 (python -m (x)) S 1 2 3 4 5 6 7 8 9 10 250 50 0 0 20 0 3 0"
    assert parse_cpu_seconds(stat, ticks=100) == 3.0
    assert parse_memory("Name:\tpython\nVmHWM:\t  2048 kB\nVmRSS:\t  1024 kB\n") == (
        1024 * 1024,
        2048 * 1024,
    )
    assert cpu_used({1: 1.0, 2: 5.0}, {1: 3.5, 3: 9.0}) == 2.5
    lines: list[dict[str, object]] = [
        {"event": "configured"},
        {"event": "starting", "memory_budget_bytes": 42},
    ]
    assert memory_budget(lines) == 42
    assert memory_budget([{"event": "starting"}]) is None


def test_the_oversized_bodies_block_is_reported_beside_without_a_floor() -> None:
    # A tenth of the clean rate among 768 MiB of bodies: reported, not a violation (the floor is
    # the header floods' block's).
    resources = measured((1, 0.8), (1.25, 1.0))
    resources.bodies = Throughput(1000, 10.0, 2.0)
    verdict = checked(resources)
    assert verdict.ok
    assert resources.describe().endswith(
        "innocents among oversized bodies: 1000 in 10.00s = 100/s, 2.00 consumer CPU-s = "
        "500/CPU-s; among header floods / clean: 0.80 wall-clock, 0.80 CPU (floor); among "
        "oversized bodies / clean: 0.10 wall-clock, 0.40 CPU (reported, no floor)"
    )


QUEUES = {"test.behave": "faulty", "test.odd": "faulty", "chaos.unknown": "faulty"}


def table_queue(event: PlannedEvent) -> str:
    """``queue-table``'s routing: the handler faults' types to ``faulty``, batches to ``batch``,
    the reference handlers' to ``stock``."""
    if event.routing_key == "test.behave_many":
        return "batch"
    return QUEUES.get(event.routing_key, "stock")


def by_queue_state(workload: Workload) -> tuple[PublishLog, EndState]:
    """A perfect end state whose dead copies each came from their own queue's DLQ."""
    log, state = perfect(workload)
    state.dead = [
        dataclasses.replace(copy, queue=table_queue(workload.by_key[copy.message_id.split(".")[0]]))
        for copy in state.dead
        if copy.message_id is not None
    ]
    return log, state


def test_a_queue_table_run_is_checked_queue_by_queue() -> None:
    # Given a table run's workload, with a crash loop, stalls and a storm in one queue
    faults = {Kind.CRASH: 2, Kind.STALL: 5, Kind.ODD_POISON: 50}
    workload = gathered(plan_workload(2_000, seed=5, faults=faults), faults.keys(), 0.25, 0.55)
    log, state = by_queue_state(workload)
    labels = ["faulty", "batch", "stock"]
    clean = check(workload, log, state, extra_dead_allowed=True)
    figures = by_queue(workload, state, clean, table_queue, labels)
    assert clean.ok, clean.violations
    assert sum(queue["to_apply"] for queue in figures.values()) == workload.to_apply
    assert all(queue["applied"] == queue["to_apply"] for queue in figures.values())

    # When an event of queue batch loses its effect and is dead-lettered in batch's DLQ (a
    # crash of the faulty queue's counted against it), and a faulty dead copy is in stock's DLQ
    victim = next(e for e in workload.of_kind(Kind.APPLIED) if e.routing_key == "test.behave_many")
    assert victim.event_id is not None
    del state.effects[victim.event_id]
    del state.receipts[victim.event_id]
    state.dead.append(DeadCopy(f"{victim.key}.0", "crashed", None, queue="batch"))
    stray = next(i for i, c in enumerate(state.dead) if c.queue == "faulty")
    state.dead[stray] = dataclasses.replace(state.dead[stray], queue="stock")
    verdict = check(workload, log, state, extra_dead_allowed=True)
    figures = by_queue(workload, state, verdict, table_queue, labels)

    # Then the counts land on queue batch alone, and the stray copy is a violation
    assert (figures["batch"]["lost"], figures["batch"]["innocent_dead"]) == (1, 1)
    assert figures["faulty"]["lost"] == figures["stock"]["lost"] == 0
    assert figures["faulty"]["strayed"] == 1
    assert any(v.startswith("not exactly once in queue batch") for v in verdict.violations)
    assert any("another queue's dead-letter queue" in v for v in verdict.violations)
    assert not any("queue stock:" in v for v in verdict.violations)


def test_gathered_moves_a_queues_trouble_into_its_stretch() -> None:
    faults = {Kind.CRASH: 2, Kind.STALL: 5, Kind.ODD_POISON: 50}
    planned = plan_workload(2_000, seed=5, faults=faults)
    workload = gathered(planned, faults.keys(), 0.25, 0.55)
    assert sorted(p.message_id for p in workload.publications) == sorted(
        p.message_id for p in planned.publications
    )
    places = [n for n, p in enumerate(workload.publications) if p.event.kind in faults]
    total = len(workload.publications)
    assert 0.2 * total < places[0]
    assert places[-1] < 0.6 * total


# -- the transactional outbox (issue 34) -------------------------------------------------------

OUTBOX_CONSUMER = "chaos-outbox"
EVERY_CAUSE = {Kind.OUTBOX: 30, Kind.OUTBOX_FLAKY: 10, Kind.OUTBOX_PERMANENT: 10}


def perfect_outbox(workload: Workload) -> tuple[PublishLog, EndState]:
    """:func:`perfect`, and each follow-up of a cause that applied: one outbox row, sent, and
    one receipt and one effect downstream."""
    log, state = perfect(workload)
    for follow_up, (cause, _) in workload.follow_ups(OUTBOX_CONSUMER).items():
        if cause.kind.applies:
            state.outbox[follow_up] = OutboxRecord(caused_by=cause.event_id)
            state.receipts[follow_up] = 1
            state.effects[follow_up] = 1
    return log, state


def outbox_check(workload: Workload, state: EndState, log: PublishLog) -> Verdict:
    return check(workload, log, state, extra_dead_allowed=True, consumer=OUTBOX_CONSUMER)


def follow_ups_of(workload: Workload, kind: Kind) -> list[uuid.UUID]:
    return [
        follow_up
        for follow_up, (cause, _) in workload.follow_ups(OUTBOX_CONSUMER).items()
        if cause.kind is kind
    ]


def test_outbox_causes_are_mixed_in_by_number_with_ids_derived_as_the_service_derives_them() -> (
    None
):
    workload = plan_workload(1_000, seed=5, faults=EVERY_CAUSE)

    kinds = Counter(event.kind for event in workload.events)
    assert {kind: kinds[kind] for kind in EVERY_CAUSE} == EVERY_CAUSE
    causes = list(workload.of_kind(*EVERY_CAUSE))
    assert {cause.routing_key for cause in causes} == {"test.outbox", "test.outbox_many"}
    assert {cause.follow_ups for cause in causes} == {1, 2, 3}
    for cause in causes:
        emit = json.loads(cause.body)["payload"]
        assert emit["count"] == cause.follow_ups
        assert emit.get("fail_transient", 0) == (1 if cause.kind is Kind.OUTBOX_FLAKY else 0)
        assert emit.get("permanent", False) is (cause.kind is Kind.OUTBOX_PERMANENT)
    assert Kind.OUTBOX_PERMANENT.dead_reason == "permanent_failure"
    follow_ups = workload.follow_ups(OUTBOX_CONSUMER)
    assert len(follow_ups) == sum(cause.follow_ups for cause in causes)
    cause = causes[0]
    assert cause.event_id is not None
    assert follow_up_id(cause.event_id, OUTBOX_CONSUMER, 0) in follow_ups
    # Another consumer's handler would write other ids.
    assert not set(follow_ups) & set(workload.follow_ups("another"))
    applying = sum(cause.follow_ups for cause in causes if cause.kind.applies)
    assert workload.effects_due == workload.to_apply + applying
    assert plan_workload(1_000, seed=5).effects_due == plan_workload(1_000, seed=5).to_apply


def test_a_faultless_end_state_with_outbox_causes_passes_every_check() -> None:
    workload = plan_workload(1_000, seed=5, faults=EVERY_CAUSE)
    log, state = perfect_outbox(workload)

    verdict = outbox_check(workload, state, log)

    assert verdict.ok, verdict.violations
    figures = verdict.figures
    assert figures.follow_ups == figures.follow_ups_applied == figures.outbox_rows > 0
    assert figures.rolled_back_ids == len(follow_ups_of(workload, Kind.OUTBOX_PERMANENT)) > 0
    assert any(note.startswith("outbox: ") for note in verdict.notes)


def test_a_follow_up_lost_applied_twice_or_unsent_is_caught() -> None:
    workload = plan_workload(1_000, seed=5, faults=EVERY_CAUSE)
    log, state = perfect_outbox(workload)
    lost, doubled, unsent, twice = follow_ups_of(workload, Kind.OUTBOX)[:4]
    del state.effects[lost]
    del state.receipts[lost]
    state.effects[doubled] = 2
    state.outbox[unsent] = dataclasses.replace(state.outbox[unsent], sent=0)
    state.outbox_owed = 1
    state.outbox[twice] = dataclasses.replace(state.outbox[twice], rows=2, sent=2)

    verdict = outbox_check(workload, state, log)

    assert verdict.figures.lost == 1
    assert verdict.figures.duplicated == 1
    assert any(v.startswith("LOST: follow-ups") for v in verdict.violations)
    assert any(v.startswith("DUPLICATED follow-up effects") for v in verdict.violations)
    [rows] = [v for v in verdict.violations if v.startswith("follow-ups without exactly one")]
    assert rows.startswith("follow-ups without exactly one outbox row sent: 2 ")
    assert "outbox rows never sent at the end: 1" in verdict.violations


def test_a_retried_cause_whose_rolled_back_rows_stayed_is_caught() -> None:
    # A flaky cause's first attempt published and raised: its rows went with the rollback, and
    # the retry wrote the same ids once. A row left from the first attempt is a second row.
    workload = plan_workload(1_000, seed=5, faults=EVERY_CAUSE)
    log, state = perfect_outbox(workload)
    flaky = follow_ups_of(workload, Kind.OUTBOX_FLAKY)[0]
    state.outbox[flaky] = dataclasses.replace(state.outbox[flaky], rows=2, sent=1)

    verdict = outbox_check(workload, state, log)

    assert any(v.startswith("follow-ups without exactly one") for v in verdict.violations)


@pytest.mark.parametrize("where", ["outbox", "receipt", "effect"])
def test_a_follow_up_of_a_cause_that_failed_for_good_found_anywhere_is_caught(where: str) -> None:
    workload = plan_workload(1_000, seed=5, faults=EVERY_CAUSE)
    log, state = perfect_outbox(workload)
    rolled_back = follow_ups_of(workload, Kind.OUTBOX_PERMANENT)[0]
    if where == "outbox":
        state.outbox[rolled_back] = OutboxRecord()
    elif where == "receipt":
        state.receipts[rolled_back] = 1
    else:
        state.effects[rolled_back] = 1

    verdict = outbox_check(workload, state, log)

    [found] = [v for v in verdict.violations if v.startswith("ROLLED BACK")]
    assert found.startswith("ROLLED BACK: follow-ups of causes that failed for good found: 1 ")


def test_an_outbox_row_no_planned_cause_wrote_is_caught() -> None:
    workload = plan_workload(1_000, seed=5, faults=EVERY_CAUSE)
    log, state = perfect_outbox(workload)
    state.outbox[uuid.uuid4()] = OutboxRecord()

    verdict = outbox_check(workload, state, log)

    assert any(v.startswith("outbox rows of no planned cause: 1") for v in verdict.violations)


def test_rows_republished_after_a_relay_kill_must_be_sent_and_applied_once() -> None:
    workload = plan_workload(1_000, seed=5, faults=EVERY_CAUSE)
    log, state = perfect_outbox(workload)
    republished = follow_ups_of(workload, Kind.OUTBOX)[:5]
    state.republished = list(republished)

    verdict = outbox_check(workload, state, log)

    assert verdict.ok, verdict.violations
    assert verdict.figures.republished == 5

    # The copy applied a second time (receipts did not absorb it), and a row never sent again.
    state.effects[republished[0]] = 2
    state.outbox[republished[1]] = dataclasses.replace(state.outbox[republished[1]], sent=0)
    state.republished_missing = 1

    verdict = outbox_check(workload, state, log)

    [not_absorbed] = [v for v in verdict.violations if v.startswith("rows republished")]
    assert not_absorbed.startswith("rows republished after a relay kill not absorbed once: 2 ")
    assert any(v.startswith("DUPLICATED follow-up effects") for v in verdict.violations)
    assert any("missing from the outbox: 1" in v for v in verdict.violations)
