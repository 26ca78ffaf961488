"""The queue table's migration plan from a service without a table, and back (pure, no broker).

The service without a table is a table of one queue (``Names.queue`` is ``None``): its work queue
leaves for the table's queues, which share its types, and what it holds is moved type by type."""

from __future__ import annotations

from datetime import timedelta
from typing import TypeVar

import pytest

from topology.migration_plan import MigrationRefused
from topology.model import Binding
from topology.names import ORIGINAL_ROUTING_KEY, RETRY_RUNG, Names
from topology.plan import TopologySpec
from topology.steps import Bind, Declare, Delete, Move, Route, Step, Unbind
from topology.table_migration import TypeMove, plan_table_migration

LADDER = (timedelta(seconds=1), timedelta(seconds=5))
TYPES = ("t.one", "t.three", "t.two")


def queue(name: str | None, *types: str, delays: tuple[timedelta, ...] = LADDER) -> TopologySpec:
    return TopologySpec(Names("svc", "events", 1, name), delays, 20, types)


def ingress(work: str, event_type: str) -> Binding:
    return Binding("events", work, event_type)


def redirect(queue: str, label: str, event_type: str | None = None) -> Binding:
    arguments = {"x-match": "all", RETRY_RUNG: label}
    if event_type is not None:
        arguments[ORIGINAL_ROUTING_KEY] = event_type
    return Binding("svc.retry", queue, arguments=arguments)


NONE = [queue(None, *TYPES)]
# a takes two of the three types, b one and a ladder of a single 2s rung
TABLE = [queue("b", "t.two", delays=(timedelta(seconds=2),)), queue("a", "t.one", "t.three")]


S = TypeVar("S", bound=Step)


def kinds(steps: tuple[Step, ...], kind: type[S]) -> list[S]:
    return [step for step in steps if isinstance(step, kind)]


def test_to_a_table_every_type_moves_from_the_one_queue_to_its_queue() -> None:
    migration = plan_table_migration(NONE, TABLE)

    assert migration.moved == (
        TypeMove("t.one", None, "a", "svc.work", "svc.a.work", drained=False),
        TypeMove("t.three", None, "a", "svc.work", "svc.a.work", drained=False),
        TypeMove("t.two", None, "b", "svc.work", "svc.b.work", drained=False),
    )
    assert migration.describe()[0] == (
        "moves t.one: from the service without a table to queue a (svc.a.work); "
        "what svc.work holds is moved"
    )


def test_to_a_table_each_type_is_bound_to_its_queue_before_it_leaves_the_one_queue() -> None:
    steps = plan_table_migration(NONE, TABLE).plan.steps

    # Both queues of the table are declared whole; the phases keep their order
    declared = [step.queue.name for step in kinds(steps, Declare)]
    assert declared == [
        "svc.b.dead",
        "svc.b.work",
        "svc.b.retry.2s",
        "svc.a.dead",
        "svc.a.work",
        "svc.a.retry.1s",
        "svc.a.retry.5s",
    ]
    for event_type, queue_name in (("t.one", "a"), ("t.two", "b"), ("t.three", "a")):
        assert steps.index(Bind(ingress(f"svc.{queue_name}.work", event_type))) < steps.index(
            Unbind(ingress("svc.work", event_type))
        )
    order = [type(step) for step in steps]
    assert order.index(Unbind) > max(i for i, kind in enumerate(order) if kind is Bind)
    assert max(i for i, kind in enumerate(order) if kind is Move) < order.index(Delete)


def test_to_a_table_an_old_replicas_retries_are_routed_by_type_to_the_heirs_rungs() -> None:
    steps = plan_table_migration(NONE, TABLE).plan.steps

    # Each rung label of the old ladder, for each type, to that type's queue's nearest rung;
    # none by label alone, which would route a retry to every queue
    binds = kinds(steps, Bind)
    for expected in (
        redirect("svc.a.retry.1s", "1s", "t.one"),
        redirect("svc.a.retry.5s", "5s", "t.three"),
        redirect("svc.b.retry.2s", "1s", "t.two"),
        redirect("svc.b.retry.2s", "5s", "t.two"),
    ):
        assert Bind(expected) in binds
    from_old_retry = [s.binding for s in binds if s.binding.exchange == "svc.retry"]
    assert len(from_old_retry) == 6
    assert all(ORIGINAL_ROUTING_KEY in binding.arguments for binding in from_old_retry)


def test_to_a_table_what_the_one_queue_holds_is_moved_by_type_then_it_is_deleted() -> None:
    steps = plan_table_migration(NONE, TABLE).plan.steps

    # a takes most of the types: the rest goes there, t.two to b
    assert kinds(steps, Move) == [
        Move("svc.retry.1s", "svc.a.retry", "1s", False, (Route("t.two", "svc.b.retry", "2s"),)),
        Move("svc.retry.5s", "svc.a.retry", "5s", False, (Route("t.two", "svc.b.retry", "2s"),)),
        Move("svc.work", "svc.a.redeliver", None, True, (Route("t.two", "svc.b.redeliver", None),)),
    ]
    assert kinds(steps, Delete) == [
        Delete("svc.retry.1s", unused=True),
        Delete("svc.retry.5s", unused=True),
        Delete("svc.work", unused=True),
    ]
    # Its dead letters stay to be read
    assert not [step for step in kinds(steps, Delete) if "dead" in step.queue]


def test_a_move_sends_each_type_to_its_route_and_the_rest_to_its_exchange() -> None:
    move = kinds(plan_table_migration(NONE, TABLE).plan.steps, Move)[-1]
    assert isinstance(move, Move)

    assert move.destination("t.two") == ("svc.b.redeliver", None)
    assert move.destination("t.one") == ("svc.a.redeliver", None)
    # A routing key no queue takes (a type bound once, since removed) goes to the heir
    assert move.destination("t.gone") == ("svc.a.redeliver", None)
    assert move.exchanges == ("svc.a.redeliver", "svc.b.redeliver")
    assert move.describe() == (
        "move the messages of svc.work by event type: t.two to exchange svc.b.redeliver, "
        "the rest to exchange svc.a.redeliver"
    )


def test_the_heir_is_the_first_queue_of_the_table_on_a_tie() -> None:
    table = [queue("b", "t.two"), queue("a", "t.one"), queue("c", "t.three")]

    moves = kinds(
        plan_table_migration([queue(None, "t.one", "t.two", "t.three")], table).plan.steps, Move
    )

    assert moves[-1] == Move(
        "svc.work",
        "svc.b.redeliver",
        None,
        True,
        (Route("t.one", "svc.a.redeliver", None), Route("t.three", "svc.c.redeliver", None)),
    )


def test_to_a_table_of_one_queue_the_one_queue_moves_whole_as_a_leaving_queue_does() -> None:
    steps = plan_table_migration(NONE, [queue("all", *TYPES, delays=())]).plan.steps

    # No ladder in the table: an old replica's retry goes straight back to the new work queue
    assert Bind(redirect("svc.all.redeliver", "1s"), to_exchange=True) in steps
    assert kinds(steps, Move) == [
        Move("svc.retry.1s", "svc.all.redeliver", None, from_work=False),
        Move("svc.retry.5s", "svc.all.redeliver", None, from_work=False),
        Move("svc.work", "svc.all.redeliver", None, from_work=True),
    ]


def test_back_to_no_table_every_queue_leaves_for_the_one_queue() -> None:
    migration = plan_table_migration(TABLE, NONE)
    steps = migration.plan.steps

    assert {move.source for move in migration.moved} == {"a", "b"}
    assert {move.target for move in migration.moved} == {None}
    assert migration.describe()[0] == (
        "moves t.one: from queue a to the service without a table (svc.work); "
        "what svc.a.work holds is moved"
    )
    # The one queue is declared whole and bound first; each table queue moved into it
    assert Bind(ingress("svc.work", "t.two")) in steps
    assert steps.index(Bind(ingress("svc.work", "t.two"))) < steps.index(
        Unbind(ingress("svc.b.work", "t.two"))
    )
    assert Move("svc.b.retry.2s", "svc.retry", "1s", from_work=False) in steps
    assert Move("svc.a.work", "svc.redeliver", None, from_work=True) in steps
    assert Move("svc.b.work", "svc.redeliver", None, from_work=True) in steps
    assert Delete("svc.a.work", unused=True) in steps
    assert Delete("svc.b.work", unused=True) in steps


def test_back_to_no_table_the_redirects_the_way_there_left_are_unbound() -> None:
    there = plan_table_migration(NONE, TABLE).plan.steps
    back = plan_table_migration(TABLE, NONE).plan.steps

    left = [s.binding for s in kinds(there, Bind) if s.binding.exchange == "svc.retry"]
    unbound = [s.binding for s in kinds(back, Unbind) if s.binding.exchange == "svc.retry"]
    assert len(left) == 6
    assert sorted(map(repr, left)) == sorted(map(repr, unbound))
    # Only after the one queue's own rungs are bound again
    assert back.index(Bind(redirect("svc.retry.1s", "1s"))) < min(
        back.index(Unbind(binding)) for binding in unbound
    )


def test_there_and_back_again_unbinds_what_the_way_back_left() -> None:
    back = plan_table_migration(TABLE, NONE).plan.steps
    again = plan_table_migration(NONE, TABLE).plan.steps

    # Each table queue's labels were routed to the one queue's rungs; going there again undoes it
    assert (
        Bind(Binding("svc.b.retry", "svc.retry.1s", arguments={"x-match": "all", RETRY_RUNG: "2s"}))
        in back
    )
    assert (
        Unbind(
            Binding("svc.b.retry", "svc.retry.1s", arguments={"x-match": "all", RETRY_RUNG: "2s"})
        )
        in again
    )


def test_a_table_queue_leaving_to_several_is_still_refused_from_a_table() -> None:
    old = [queue("c", *TYPES)]

    with pytest.raises(MigrationRefused, match=r"queue c leaves the table .* to 2 queues"):
        plan_table_migration(old, TABLE)


def test_a_plan_mixing_the_one_queue_with_a_tables_queues_is_refused() -> None:
    with pytest.raises(MigrationRefused, match="mixes the queue of a service without a table"):
        plan_table_migration([*NONE, queue("a", "t.four")], TABLE)


def test_without_a_table_on_both_sides_the_plan_is_the_settings_migration() -> None:
    new = [queue(None, *TYPES, delays=(timedelta(seconds=1),))]

    migration = plan_table_migration(NONE, new)

    assert migration.moved == ()
    assert Delete("svc.retry.5s", unused=True) in migration.plan.steps


def test_to_a_table_an_old_replicas_retry_goes_to_one_rung_only() -> None:
    # While the old rungs wait to be emptied and deleted, their own bindings would route an old
    # replica's retry there too: a second copy in the ladders, run and dead-lettered twice.
    steps = plan_table_migration(NONE, TABLE).plan.steps

    unbinds = kinds(steps, Unbind)
    for label in ("1s", "5s"):
        assert Unbind(redirect(f"svc.retry.{label}", label)) in unbinds
    # After the redirects are bound: never a moment that routes a retry nowhere
    last_bind = max(i for i, step in enumerate(steps) if isinstance(step, Bind))
    first_unbind = steps.index(Unbind(redirect("svc.retry.1s", "1s")))
    assert first_unbind > last_bind


def test_back_to_no_table_a_table_replicas_retry_goes_to_one_rung_only() -> None:
    steps = plan_table_migration(TABLE, NONE).plan.steps

    unbinds = kinds(steps, Unbind)
    assert (
        Unbind(
            Binding("svc.b.retry", "svc.b.retry.2s", arguments={"x-match": "all", RETRY_RUNG: "2s"})
        )
        in unbinds
    )
    for label in ("1s", "5s"):
        assert (
            Unbind(
                Binding(
                    "svc.a.retry",
                    f"svc.a.retry.{label}",
                    arguments={"x-match": "all", RETRY_RUNG: label},
                )
            )
            in unbinds
        )
