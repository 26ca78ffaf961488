"""The migration plan: old plan -> new plan as ordered steps (pure, no broker)."""

from __future__ import annotations

from dataclasses import replace
from datetime import timedelta
from typing import TypeVar

import pytest

from topology.migration_plan import MigrationRefused, plan_migration
from topology.model import Binding
from topology.names import RETRY_RUNG, Names
from topology.plan import TopologySpec, build_topology
from topology.steps import Bind, Declare, Delete, MigrationPlan, Move, Step, Unbind

S = TypeVar("S", Declare, Bind, Unbind, Move, Delete)
TYPES = ("inventory.restock", "test.behave")


def ms(*values: int) -> tuple[timedelta, ...]:
    return tuple(timedelta(milliseconds=value) for value in values)


def spec(
    delays: tuple[timedelta, ...] = ms(200, 400, 800), limit: int = 20, version: int = 1
) -> TopologySpec:
    return TopologySpec(Names("svc", "svc.events", version), delays, limit, TYPES)


def kinds(plan: MigrationPlan, kind: type[S]) -> list[S]:
    return [step for step in plan.steps if isinstance(step, kind)]


def _rung(queue: str, label: str) -> Binding:
    """The retry exchange's binding for one rung label."""
    return Binding("svc.retry", queue, arguments={"x-match": "all", RETRY_RUNG: label})


def index(plan: MigrationPlan, step: Step) -> int:
    return plan.steps.index(step)


def test_the_same_plan_needs_no_step() -> None:
    assert plan_migration(spec(), spec()).changes_nothing


def test_a_new_ladder_adds_rungs_redirects_leaving_labels_and_keeps_the_work_queue() -> None:
    plan = plan_migration(spec(ms(200, 400, 800)), spec(ms(200, 1000)))

    assert [step.queue.name for step in kinds(plan, Declare)] == ["svc.retry.1s"]
    assert kinds(plan, Move) == [
        Move("svc.retry.400ms", "svc.retry", "200ms", from_work=False),
        Move("svc.retry.800ms", "svc.retry", "200ms", from_work=False),
    ]
    assert kinds(plan, Delete) == [
        Delete("svc.retry.400ms", unused=True),
        Delete("svc.retry.800ms", unused=True),
    ]
    # Nothing of the work queue's: same name, same arguments.
    assert not any("svc.work" in step.describe() for step in plan.steps)
    # An old replica's retry labelled 800ms is routed (to the nearest shorter rung) before the
    # 800ms rung stops taking it, so it is never returned unroutable.
    redirect = Bind(_rung("svc.retry.200ms", "800ms"))
    leave = Unbind(_rung("svc.retry.800ms", "800ms"))
    assert index(plan, redirect) < index(plan, leave)


def test_a_new_delivery_limit_is_a_new_work_queue_drained_then_deleted() -> None:
    plan = plan_migration(spec(limit=20), spec(limit=30, version=2))

    declared = kinds(plan, Declare)
    assert len(declared) == 1
    assert declared[0].queue.name == "svc.work.v2"
    assert declared[0].queue.arguments["x-delivery-limit"] == 30
    assert kinds(plan, Move) == [Move("svc.work", "svc.redeliver", None, from_work=True)]
    assert plan.steps[-1] == Delete("svc.work", unused=True)
    binds = [step.binding for step in kinds(plan, Bind)]
    unbinds = [step.binding for step in kinds(plan, Unbind)]
    assert {(b.exchange, b.routing_key) for b in binds if b.queue == "svc.work.v2"} == {
        ("svc.events", "inventory.restock"),
        ("svc.events", "test.behave"),
        ("svc.redeliver", ""),
    }
    assert {(b.exchange, b.queue) for b in unbinds} == {
        ("svc.events", "svc.work"),
        ("svc.redeliver", "svc.work"),
    }


def test_both_changes_keep_the_order_that_loses_nothing() -> None:
    old = spec(ms(200, 400, 800), 20)
    plan = plan_migration(old, spec(ms(200, 1000), 30, version=2))

    old_routes = build_topology(old).bindings
    last_declare = max(index(plan, step) for step in kinds(plan, Declare))
    first_bind = min(index(plan, step) for step in kinds(plan, Bind))
    first_unbind_of_old = min(
        index(plan, step) for step in kinds(plan, Unbind) if step.binding in old_routes
    )
    last_bind = max(index(plan, step) for step in kinds(plan, Bind))
    first_move = min(index(plan, step) for step in kinds(plan, Move))
    last_unbind = max(index(plan, step) for step in kinds(plan, Unbind))
    first_delete = min(index(plan, step) for step in kinds(plan, Delete))
    # declare < bind (every route to the new plan) < unbind (the old routes) < move < delete
    assert last_declare < first_bind
    assert last_bind < first_unbind_of_old
    assert last_unbind < first_move
    assert max(index(plan, step) for step in kinds(plan, Move)) < first_delete
    assert plan.steps[-1] == Delete("svc.work", unused=True)
    # Every step can be printed (--dry-run), numbered.
    lines = plan.describe()
    assert lines[0].startswith(" 1. declare queue svc.work.v2 (quorum;")
    assert lines[-1] == f"{len(lines):>2}. delete queue svc.work once empty and without consumers"


def test_migrating_back_removes_the_redirects_of_the_migration_it_undoes() -> None:
    forward = plan_migration(spec(ms(200, 400, 800)), spec(ms(200, 1000)))
    back = plan_migration(spec(ms(200, 1000)), spec(ms(200, 400, 800)))

    redirects = [s for s in kinds(forward, Bind) if s.binding.queue == "svc.retry.200ms"]
    assert len(redirects) == 2
    for redirect in redirects:
        assert Unbind(redirect.binding) in back.steps
    # ... and the rung the forward migration added leaves the same way, redirected first.
    assert Bind(_rung("svc.retry.800ms", "1s")) in back.steps
    assert Delete("svc.retry.1s", unused=True) in back.steps


def test_no_ladder_left_sends_waiting_retries_straight_back_to_work() -> None:
    plan = plan_migration(spec(ms(200)), spec(()))

    assert Bind(_rung("svc.redeliver", "200ms"), to_exchange=True) in plan.steps
    assert Move("svc.retry.200ms", "svc.redeliver", None, from_work=False) in plan.steps
    assert plan.steps[-1] == Delete("svc.retry.200ms", unused=True)


def test_a_new_delivery_limit_on_the_same_work_queue_is_refused_naming_the_setting() -> None:
    with pytest.raises(MigrationRefused, match="set CONSUMER_WORK_QUEUE_VERSION=2"):
        plan_migration(spec(limit=20), spec(limit=30))


def test_a_new_service_name_is_refused() -> None:
    other = TopologySpec(Names("other", "svc.events"), ms(200), 20, TYPES)
    with pytest.raises(MigrationRefused, match="CONSUMER_NAME"):
        plan_migration(spec(), other)


def test_the_second_work_queue_generation_is_named_by_its_version() -> None:
    assert Names("svc", "events").work == "svc.work"
    assert Names("svc", "events", work_version=2).work == "svc.work.v2"


def test_a_new_ack_timeout_on_the_same_work_queue_is_refused_naming_the_setting() -> None:
    # RabbitMQ accepts x-consumer-timeout on an existing queue's redeclaration without applying
    # it: the same work queue would keep its old timeout while the migration said all was done.
    timed = replace(spec(), ack_timeout=timedelta(hours=1))
    for old, new in ((spec(), timed), (timed, spec()), (timed, replace(timed, ack_timeout=None))):
        with pytest.raises(MigrationRefused, match=r"ack_timeout.*CONSUMER_WORK_QUEUE_VERSION=2"):
            plan_migration(old, new)


def test_a_new_ack_timeout_on_a_new_work_queue_generation_declares_it_with_the_argument() -> None:
    timed = replace(spec(version=2), ack_timeout=timedelta(hours=1))
    plan = plan_migration(spec(), timed)
    (work,) = [step.queue for step in kinds(plan, Declare) if step.queue.name == "svc.work.v2"]
    assert work.arguments["x-consumer-timeout"] == 3_600_000
