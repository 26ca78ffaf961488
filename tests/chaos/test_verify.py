"""The chaos checks themselves, on made-up end states: each invariant catches what it is for."""

from __future__ import annotations

import uuid
from collections import Counter

from tests.chaos.observe import DeadCopy, EndState
from tests.chaos.producer import Attempt, PublishLog
from tests.chaos.verify import check
from tests.chaos.workload import DUPLICATE_SHARE, MIX, Kind, Workload, plan_workload


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
                None if event.kind.poison else "permanent_failure",
                "rejected" if event.kind.poison else None,
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
        if event.kind is Kind.RESTOCK:
            state.movements[event.event_id] = 1
        else:
            state.effects[event.event_id] = 1
    state.stock = workload.restocked()
    return log, state


def test_the_workload_mixes_every_kind_and_ten_percent_duplicates() -> None:
    workload = plan_workload(2_000, seed=3)

    assert len(workload.publications) == 2_000
    assert sum(p.copy for p in workload.publications) == round(2_000 * DUPLICATE_SHARE)
    kinds = Counter(event.kind for event in workload.events)
    assert set(kinds) == set(MIX)
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
