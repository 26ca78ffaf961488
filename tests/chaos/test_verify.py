"""The chaos checks themselves, on made-up end states: each invariant catches what it is for."""

from __future__ import annotations

import uuid
from collections import Counter

from tests.chaos.observe import DeadCopy, EndState
from tests.chaos.producer import Attempt, PublishLog
from tests.chaos.verify import check
from tests.chaos.workload import (
    DUPLICATE_SHARE,
    HANDLER_FAULTS,
    MIX,
    Kind,
    PlannedEvent,
    Workload,
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


def perfect(workload: Workload) -> tuple[PublishLog, EndState]:
    """What a faultless run leaves: every publication confirmed, everything where it belongs."""
    log = PublishLog()
    state = EndState()
    for publication in workload.publications:
        log.attempts[publication.message_id] = Attempt.CONFIRMED
        event = publication.event
        if event.kind.applies:
            continue
        state.dead.append(
            DeadCopy(
                publication.message_id,
                event.kind.header_reason,
                "rejected" if event.kind.poison else None,
                error_class=event.kind.error_class,
            )
        )
        state.listed.append(
            {"id": str(event.event_id or publication.message_id), "reason": event.kind.dead_reason}
        )
    for event in workload.events:
        if not event.kind.applies:
            continue
        assert event.event_id is not None
        state.receipts[event.event_id] = 1
        rows(state, event)[event.event_id] = 1
    state.stock = workload.stock()
    return log, state


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
    resent = DeadCopy(f"{poison.message_id}~1", None, "rejected")
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
