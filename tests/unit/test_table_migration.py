"""The queue table's migration plan: old table -> new table as ordered steps (pure, no broker)."""

from __future__ import annotations

from datetime import timedelta

import pytest

from topology.migration_plan import MigrationRefused
from topology.model import Binding
from topology.names import RETRY_RUNG, Names
from topology.plan import TopologySpec
from topology.steps import Bind, Declare, DeclareExchange, Delete, Move, Step, Unbind
from topology.table_migration import TypeMove, plan_table_migration

LADDER = (timedelta(seconds=1), timedelta(seconds=5))


def queue(
    name: str, *types: str, delays: tuple[timedelta, ...] = LADDER, version: int = 1
) -> TopologySpec:
    return TopologySpec(Names("svc", "events", version, name), delays, 20, types)


def ingress(work: str, event_type: str) -> Binding:
    return Binding("events", work, event_type)


def rung(exchange: str, queue: str, label: str) -> Binding:
    return Binding(exchange, queue, arguments={"x-match": "all", RETRY_RUNG: label})


OLD = [queue("a", "t.one", "t.two"), queue("b", "t.three")]
MOVED = [queue("a", "t.one"), queue("b", "t.three", "t.two")]


def test_the_same_table_needs_no_step() -> None:
    migration = plan_table_migration(OLD, OLD)

    assert migration.changes_nothing
    assert migration.moved == ()


def test_a_type_moving_is_bound_to_its_new_queue_before_it_is_unbound_from_the_old() -> None:
    migration = plan_table_migration(OLD, MOVED)

    assert migration.moved == (
        TypeMove("t.two", "a", "b", "svc.a.work", "svc.b.work", drained=True),
    )
    assert migration.plan.steps == (
        Bind(ingress("svc.b.work", "t.two")),
        Unbind(ingress("svc.a.work", "t.two")),
    )


def test_the_old_queue_of_a_moved_type_is_drained_by_its_consumers_not_moved() -> None:
    migration = plan_table_migration(OLD, MOVED)

    assert not [step for step in migration.plan.steps if isinstance(step, Move | Delete)]
    assert "svc.a.work's consumers apply what it already holds of it" in (
        migration.moved[0].describe()
    )


def test_a_rollback_is_the_migration_back() -> None:
    migration = plan_table_migration(MOVED, OLD)

    assert migration.moved == (
        TypeMove("t.two", "b", "a", "svc.b.work", "svc.a.work", drained=True),
    )
    assert migration.plan.steps == (
        Bind(ingress("svc.a.work", "t.two")),
        Unbind(ingress("svc.b.work", "t.two")),
    )


def test_every_binding_comes_before_any_unbinding_across_queues() -> None:
    # Two types swap queues, and queue a gets a new work queue generation meanwhile
    old = [queue("a", "t.one", "t.two"), queue("b", "t.three")]
    new = [queue("a", "t.one", "t.three", version=2), queue("b", "t.two")]

    steps = plan_table_migration(old, new).plan.steps

    def last(kind: type) -> int:
        return max(i for i, step in enumerate(steps) if isinstance(step, kind))

    def first(kind: type) -> int:
        return min(i for i, step in enumerate(steps) if isinstance(step, kind))

    assert last(Declare) < first(Bind)
    assert last(Bind) < first(Unbind)
    assert last(Unbind) < first(Move)
    assert last(Move) < first(Delete)
    assert Move("svc.a.work", "svc.a.redeliver", None, from_work=True) in steps
    assert Bind(ingress("svc.b.work", "t.two")) in steps
    assert Unbind(ingress("svc.b.work", "t.three")) in steps


def test_a_queue_new_to_the_table_is_declared_whole() -> None:
    new = [queue("a", "t.one"), queue("b", "t.three"), queue("c", "t.two", delays=())]

    migration = plan_table_migration(OLD, new)

    assert migration.moved == (
        TypeMove("t.two", "a", "c", "svc.a.work", "svc.c.work", drained=True),
    )
    steps = migration.plan.steps
    declared = [s.exchange.name for s in steps if isinstance(s, DeclareExchange)]
    assert declared == ["svc.c.dlx", "svc.c.retry", "svc.c.redeliver"]
    assert [s.queue.name for s in steps if isinstance(s, Declare)] == ["svc.c.dead", "svc.c.work"]
    assert steps.index(Bind(ingress("svc.c.work", "t.two"))) < steps.index(
        Unbind(ingress("svc.a.work", "t.two"))
    )


def test_a_queue_leaving_the_table_has_what_it_holds_moved_to_its_heir() -> None:
    # Given queue b's only type going to queue a, whose ladder has a 1s rung only
    new = [queue("a", "t.one", "t.two", "t.three", delays=(timedelta(seconds=1),))]

    migration = plan_table_migration(OLD, new)

    assert migration.moved == (
        TypeMove("t.three", "b", "a", "svc.b.work", "svc.a.work", drained=False),
    )
    steps: tuple[Step, ...] = migration.plan.steps
    # Its old replicas' retries are routed to the heir's nearest rung while they last
    assert Bind(rung("svc.b.retry", "svc.a.retry.1s", "5s")) in steps
    assert Bind(rung("svc.b.retry", "svc.a.retry.1s", "1s")) in steps
    assert steps.index(Bind(ingress("svc.a.work", "t.three"))) < steps.index(
        Unbind(ingress("svc.b.work", "t.three"))
    )
    moves = [step for step in steps if isinstance(step, Move)]
    assert Move("svc.b.retry.5s", "svc.a.retry", "1s", from_work=False) in moves
    assert Move("svc.b.work", "svc.a.redeliver", None, from_work=True) in moves
    deletes = [step for step in steps if isinstance(step, Delete)]
    # Its rungs, then its work queue; its dead letters stay
    assert deletes[-3:] == [
        Delete("svc.b.retry.1s", unused=True),
        Delete("svc.b.retry.5s", unused=True),
        Delete("svc.b.work", unused=True),
    ]
    assert not [d for d in deletes if d.queue == "svc.b.dead"]


def test_the_rollback_of_a_queue_leaving_unbinds_the_redirects_it_left() -> None:
    new = [queue("a", "t.one", "t.two", "t.three", delays=(timedelta(seconds=1),))]

    steps = plan_table_migration(new, OLD).plan.steps

    assert Unbind(rung("svc.b.retry", "svc.a.retry.1s", "5s")) in steps
    assert steps.index(Bind(rung("svc.b.retry", "svc.b.retry.5s", "5s"))) < steps.index(
        Unbind(rung("svc.b.retry", "svc.a.retry.1s", "5s"))
    )


def test_a_queue_leaving_to_several_queues_is_refused() -> None:
    old = [queue("a", "t.one", "t.two"), queue("b", "t.three")]
    new = [queue("b", "t.three", "t.one"), queue("c", "t.two")]

    with pytest.raises(MigrationRefused, match=r"queue a leaves the table .* to 2 queues"):
        plan_table_migration(old, new)


def test_a_new_service_name_is_refused() -> None:
    renamed = [TopologySpec(Names("other", "events", 1, "a"), LADDER, 20, ("t.one", "t.two"))]

    with pytest.raises(MigrationRefused, match="CONSUMER_NAME"):
        plan_table_migration(OLD[:1], renamed)


def test_a_plan_without_a_table_that_takes_none_of_a_queues_types_is_refused() -> None:
    # A service without a table is a table of one queue (test_table_migration_no_table.py)
    plain = [TopologySpec(Names("svc", "events"), LADDER, 20, ("t.one",))]

    with pytest.raises(MigrationRefused, match="queue b leaves the table and its types go nowhere"):
        plan_table_migration(OLD, plain)


def test_a_dry_run_names_the_moving_types_then_the_steps() -> None:
    lines = plan_table_migration(OLD, MOVED).describe()

    assert lines[0].startswith("moves t.two: from queue a to queue b (svc.b.work)")
    assert lines[1] == " 1. bind events -> svc.b.work with routing key 't.two'"
    assert lines[2] == " 2. unbind events -> svc.a.work with routing key 't.two'"
