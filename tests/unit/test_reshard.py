"""Resharding: a sharded queue's migration from N shards to M, as ordered steps (pure, no broker).
The integration test under load is tests/integration/test_reshard.py."""

from __future__ import annotations

from datetime import timedelta

import pytest

from topology.bindings import compare_bindings
from topology.migration_plan import MigrationRefused, plan_migration
from topology.model import Binding, Topology
from topology.names import SHARD, Names
from topology.plan import TopologySpec, build_topology
from topology.reshard import redirect_binding
from topology.steps import Bind, Declare, Delete, MigrationPlan, Move, Step, Unbind
from topology.table_migration import plan_table_migration

LADDER = (timedelta(seconds=1), timedelta(seconds=5))


def queue(shards: int, name: str = "q", *types: str, version: int = 1) -> TopologySpec:
    return TopologySpec(
        Names("svc", "events", version, name), LADDER, 20, types or ("t.one",), shards=shards
    )


def hash_to(shard: int) -> Binding:
    return Binding("svc.q.hash", f"svc.q.work.s{shard}", "1")


def back_to(shard: int) -> Binding:
    return Binding(
        "svc.q.redeliver", f"svc.q.work.s{shard}", arguments={"x-match": "all", SHARD: f"s{shard}"}
    )


def redirect(shard: int) -> Binding:
    return redirect_binding(queue(2), shard)


def index(plan: MigrationPlan, step: Step) -> int:
    return plan.steps.index(step)


def test_the_redirect_sends_a_leaving_shard_s_retries_to_the_hash_exchange() -> None:
    assert redirect(4) == Binding(
        "svc.q.redeliver",
        "svc.q.hash",
        arguments={"x-match": "all", SHARD: "s4"},
        to_exchange=True,
    )


# -- more shards --------------------------------------------------------------------------------


def test_more_shards_declares_them_binds_their_returns_then_their_hash_bindings_in_order() -> None:
    plan = plan_migration(queue(3), queue(5))

    assert plan.steps == (
        Declare(build_topology(queue(5)).queues[4]),
        Declare(build_topology(queue(5)).queues[5]),
        Bind(back_to(4)),
        Bind(hash_to(4)),
        Bind(back_to(5)),
        Bind(hash_to(5)),
        Unbind(redirect(4), to_exchange=True),
        Unbind(redirect(5), to_exchange=True),
    )
    assert [step.queue.name for step in plan.steps[:2] if isinstance(step, Declare)] == [
        "svc.q.work.s4",
        "svc.q.work.s5",
    ]


def test_more_shards_moves_and_deletes_nothing_the_old_shards_are_drained_by_their_consumers() -> (
    None
):
    plan = plan_migration(queue(3), queue(5))

    assert not [step for step in plan.steps if isinstance(step, Move | Delete)]
    # the old shards keep every binding they had
    assert not [
        step
        for step in plan.steps
        if isinstance(step, Unbind) and step.binding.queue.startswith("svc.q.work.s")
    ]


def test_a_new_shard_s_retries_come_back_to_it_before_any_key_is_hashed_to_it() -> None:
    plan = plan_migration(queue(2), queue(3))

    assert index(plan, Bind(back_to(3))) < index(plan, Bind(hash_to(3)))


# -- fewer shards -------------------------------------------------------------------------------


def test_fewer_shards_redirects_their_retries_before_anything_is_unbound() -> None:
    plan = plan_migration(queue(5), queue(2))
    redirects = [Bind(redirect(shard), to_exchange=True) for shard in (5, 4, 3)]
    unbinds = [step for step in plan.steps if isinstance(step, Unbind)]

    assert plan.steps[:3] == tuple(redirects)
    assert all(index(plan, unbind) > 2 for unbind in unbinds)


def test_fewer_shards_unbinds_the_hash_exchange_from_the_last_shard_first() -> None:
    # removing the last bucket of the ring first leaves every staying shard its bucket number,
    # so the staying shards' keys stay where they are
    plan = plan_migration(queue(5), queue(2))
    unbinds = [step.binding for step in plan.steps if isinstance(step, Unbind)]

    assert unbinds == [hash_to(5), hash_to(4), hash_to(3), back_to(5), back_to(4), back_to(3)]


def test_fewer_shards_moves_each_leaving_shard_through_the_redeliver_exchange_as_itself() -> None:
    plan = plan_migration(queue(5), queue(2))
    moves = [step for step in plan.steps if isinstance(step, Move)]

    assert moves == [
        Move(f"svc.q.work.s{s}", "svc.q.redeliver", None, from_work=True, shard=f"s{s}")
        for s in (5, 4, 3)
    ]
    # routed by the redirect bound in the same plan: to the hash exchange, by the copy's key
    assert all(index(plan, Bind(redirect(5), to_exchange=True)) < index(plan, m) for m in moves)
    assert moves[0].describe() == (
        "move the messages of svc.q.work.s5 to exchange svc.q.redeliver as consumer-shard: s5, "
        "each to the shard its key has now"
    )


def test_fewer_shards_deletes_each_leaving_shard_last_once_empty_and_unconsumed() -> None:
    plan = plan_migration(queue(5), queue(2))

    assert plan.steps[-3:] == tuple(
        Delete(f"svc.q.work.s{shard}", unused=True) for shard in (5, 4, 3)
    )
    assert plan.steps[-1].describe() == (
        "delete queue svc.q.work.s3 once empty and without consumers"
    )


def test_the_staying_shards_are_not_touched() -> None:
    plan = plan_migration(queue(5), queue(2))
    touched = {
        step.binding.queue if isinstance(step, Bind | Unbind) else getattr(step, "source", "")
        for step in plan.steps
    }

    assert not touched & {"svc.q.work.s1", "svc.q.work.s2"}


# -- back and forth -----------------------------------------------------------------------------


def test_growing_again_unbinds_the_redirects_shrinking_left() -> None:
    down = plan_migration(queue(4), queue(2))
    up = plan_migration(queue(2), queue(4))

    left = [step.binding for step in down.steps if isinstance(step, Bind)]
    removed = [step.binding for step in up.steps if isinstance(step, Unbind)]
    assert left == [redirect(4), redirect(3)]
    assert removed == [redirect(3), redirect(4)]


def test_a_rollback_is_the_migration_back() -> None:
    # --rollback plans from the new table to the old one: the same function, the other way
    assert plan_migration(queue(5), queue(3)) != plan_migration(queue(3), queue(5))
    assert plan_migration(queue(3), queue(3)).changes_nothing


def test_a_ladder_change_and_a_reshard_go_together() -> None:
    new = TopologySpec(
        Names("svc", "events", 1, "q"), (timedelta(seconds=2),), 20, ("t.one",), shards=2
    )
    plan = plan_migration(queue(3), new)
    kinds = [type(step).__name__ for step in plan.steps]

    assert "Move" in kinds
    assert "Delete" in kinds
    moved = {step.source for step in plan.steps if isinstance(step, Move)}
    assert moved == {"svc.q.retry.1s", "svc.q.retry.5s", "svc.q.work.s3"}


def test_a_reshard_needs_the_shard_beyond_the_counts_it_was_given_absent_on_the_broker() -> None:
    # A shard beyond the old count (fewer shards) or the new one (more) on the broker says the
    # install has more shards than the tables say: an earlier migration to fewer shards not
    # finished, or a wrong --from-queues-file. Its shards would be left bound to the hash
    # exchange, taking keys no replica consumes, or holding what nobody moves.
    assert plan_migration(queue(3), queue(2)).absent == ("svc.q.work.s4",)
    assert plan_migration(queue(2), queue(4)).absent == ("svc.q.work.s5",)
    assert plan_migration(queue(3), queue(3)).absent == ()
    assert plan_migration(queue(1), queue(1)).absent == ()
    table = plan_table_migration([queue(3)], [queue(2)])
    assert table.plan.absent == ("svc.q.work.s4",)


# -- refused ------------------------------------------------------------------------------------


@pytest.mark.parametrize(("old", "new"), [(1, 3), (3, 1)])
def test_one_shard_to_several_and_back_is_refused_with_one_line(old: int, new: int) -> None:
    with pytest.raises(MigrationRefused) as refused:
        plan_migration(queue(old), queue(new))

    assert str(refused.value) == (
        f"queue q: from shards = {old} to {new} is not built: an unsharded queue's redeliver "
        "exchange is fanout, a sharded one's headers, and RabbitMQ cannot change an exchange's "
        "type; reshard between 2 or more shards"
    )


def test_a_new_shard_count_and_a_new_generation_at_once_are_refused() -> None:
    with pytest.raises(MigrationRefused, match="migrate one, then the other"):
        plan_migration(queue(3), queue(5, version=2))


def test_a_new_generation_of_a_sharded_queue_is_refused() -> None:
    with pytest.raises(MigrationRefused, match="work_queue_version of a sharded queue"):
        plan_migration(queue(3), queue(3, version=2))


# -- in a queue table ---------------------------------------------------------------------------


def test_a_table_reshards_its_sharded_queue_beside_its_other_queues() -> None:
    old = [queue(3, "q", "t.one"), queue(1, "r", "t.two")]
    new = [queue(2, "q", "t.one"), queue(1, "r", "t.two")]

    migration = plan_table_migration(old, new)

    assert migration.plan == plan_migration(old[0], new[0])
    assert not migration.moved


def test_a_type_moving_into_a_sharded_queue_is_bound_to_its_hash_exchange() -> None:
    old = [queue(3, "q", "t.one"), queue(1, "r", "t.two", "t.three")]
    new = [queue(3, "q", "t.one", "t.three"), queue(1, "r", "t.two")]

    plan = plan_table_migration(old, new).plan

    assert plan.steps == (
        Bind(Binding("events", "svc.q.hash", "t.three", to_exchange=True)),
        Unbind(Binding("events", "svc.r.work", "t.three")),
    )


def test_a_sharded_queue_leaving_the_table_is_refused_with_one_line() -> None:
    old = [queue(3, "q", "t.one"), queue(1, "r", "t.two")]
    new = [queue(1, "r", "t.two", "t.one")]

    with pytest.raises(MigrationRefused) as refused:
        plan_table_migration(old, new)

    assert str(refused.value) == (
        "queue q has shards = 3 and leaves the table: not built; keep it in the table until its "
        "shards are drained"
    )


# -- topology check after a reshard --------------------------------------------------------------


def test_check_does_not_count_the_redirects_of_removed_shards_against_the_plan() -> None:
    plan = build_topology(queue(2))

    differences = compare_bindings(plan, [*plan.bindings, redirect(3), redirect(4)])

    assert differences.describe() == []


def test_check_still_names_a_redirect_of_a_shard_the_plan_has() -> None:
    # it would send every retry of s2 to the hash exchange as well as back to s2
    plan = build_topology(queue(2))

    differences = compare_bindings(plan, [*plan.bindings, redirect(2)])

    assert differences.describe() == [f"not in the plan: {redirect(2).describe()}"]


def test_check_judges_a_redirect_by_its_own_queue_s_shards_not_another_queue_s() -> None:
    # q went from 3 shards to 2 beside r, which has 3: q's redirect of s3 is a retired one (q
    # has no s3), though r has an s3; and a binding of q's redeliver exchange to r's hash
    # exchange is no redirect a reshard makes
    plan = Topology.merge([build_topology(queue(2)), build_topology(queue(3, "r"))])
    across = Binding(
        "svc.q.redeliver",
        "svc.r.hash",
        arguments={"x-match": "all", SHARD: "s7"},
        to_exchange=True,
    )

    assert compare_bindings(plan, [*plan.bindings, redirect(3)]).describe() == []
    assert compare_bindings(plan, [*plan.bindings, across]).describe() == [
        f"not in the plan: {across.describe()}"
    ]


def test_apply_removes_the_redirects_of_the_plan_s_own_shards_and_only_a_sharded_plan() -> None:
    # a table grown back by apply after a migration to fewer shards: each shard's retries must
    # come back to it alone
    assert build_topology(queue(3)).unbindings == (redirect(1), redirect(2), redirect(3))
    assert build_topology(TopologySpec(Names("svc", "events"), LADDER, 20, ("t",))).unbindings == ()


def test_a_queue_leaving_the_table_for_a_sharded_queue_is_refused_with_one_line() -> None:
    # its messages and an old replica's retries would reach the sharded queue's redeliver
    # exchange with no consumer-shard header, and be dropped at the end of a rung
    old = [queue(3, "q", "t.one"), queue(1, "r", "t.two")]
    new = [queue(3, "q", "t.one", "t.two")]

    with pytest.raises(MigrationRefused) as refused:
        plan_table_migration(old, new)

    assert str(refused.value) == (
        "queue r leaves the table for sharded queue q: not built; keep it in the table"
    )


def test_a_sharded_queue_new_to_the_table_is_declared_whole_with_its_hash_exchange() -> None:
    old = [queue(1, "r", "t.one", "t.two")]
    new = [queue(1, "r", "t.one"), queue(3, "q", "t.two")]

    plan = plan_table_migration(old, new).plan
    declared = [step.describe() for step in plan.steps if type(step).__name__ == "DeclareExchange"]

    assert (
        "declare exchange svc.q.hash (x-consistent-hash, durable; hash-header=consumer-shard-key)"
        in declared
    )
    assert [step.queue.name for step in plan.steps if isinstance(step, Declare)][1:4] == [
        "svc.q.work.s1",
        "svc.q.work.s2",
        "svc.q.work.s3",
    ]
    binds = [step.binding for step in plan.steps if isinstance(step, Bind)]
    assert Binding("events", "svc.q.hash", "t.two", to_exchange=True) in binds
    unbind = Unbind(Binding("events", "svc.r.work", "t.two"))
    assert plan.steps.index(unbind) > max(plan.steps.index(Bind(b)) for b in binds)
