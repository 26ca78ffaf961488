"""From one topology plan to another: the ordered steps of ``consumer topology migrate``, as data.

RabbitMQ cannot change a queue's arguments, so a new plan is reached by adding queues, moving
bindings and messages, and deleting what the new plan no longer has:

1. declare the queues only the new plan has (a new work queue generation, new rungs);
2. bind them (the ingress and the redeliver exchange to the new work queue, the retry exchange
   to each new rung), and point each leaving rung's label at the nearest remaining rung, so a
   replica still running the old ladder keeps having its retries routed (never returned);
3. unbind what only the old plan had: from then on nothing new enters an old queue;
4. move what the leaving rungs and the old work queue hold into the new plan;
5. delete the leaving rungs, then the old work queue, each only when empty and no one consumes
   it any more (an old replica, or a tool reading a rung).

Binding before unbinding leaves a moment in which an event is routed to both work queues: the
receipts make the second copy a duplicate. The other order would leave one in which it is routed
to neither, and lost. Every step checks the broker before it acts, so running the same migration
again resumes it, and migrating back (the same steps from the new plan to the old) rolls it back.

A sharded queue whose shard count changes gains or loses shards by :mod:`topology.reshard`'s
steps, each put among the steps of its kind.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from topology.model import Binding
from topology.names import RETRY_RUNG, rung_label
from topology.plan import TopologySpec, build_topology
from topology.reshard import plan_reshard, reshard_refusal
from topology.steps import (
    Bind,
    Declare,
    Delete,
    MigrationPlan,
    Move,
    Step,
    Unbind,
)

__all__ = [
    "MigrationRefused",
    "nearest_rung",
    "plan_migration",
    "rung_binding",
]


class MigrationRefused(ValueError):
    """The two plans cannot be migrated between (the message says which setting to change)."""


def rung_binding(retry: str, queue: str, delay: timedelta) -> Binding:
    """The binding that routes the retry exchange's rung ``delay`` to ``queue`` (a rung, or an
    exchange)."""
    return Binding(retry, queue, arguments={"x-match": "all", RETRY_RUNG: rung_label(delay)})


def _key(binding: Binding) -> tuple[object, ...]:
    # A binding's arguments are a read-only mapping, which does not hash.
    arguments = tuple(sorted(binding.arguments.items()))
    return (binding.exchange, binding.queue, binding.routing_key, arguments)


def nearest_rung(delay: timedelta, ladder: Iterable[timedelta]) -> timedelta | None:
    """The longest delay of ``ladder`` not above ``delay``, else its shortest; None if empty."""
    delays = sorted(ladder)
    if not delays:
        return None
    shorter = [candidate for candidate in delays if candidate <= delay]
    return shorter[-1] if shorter else delays[0]


def _check(old: TopologySpec, new: TopologySpec) -> None:
    if (old.names.service, old.names.ingress) != (new.names.service, new.names.ingress):
        raise MigrationRefused(
            "a migration keeps CONSUMER_NAME and CONSUMER_EXCHANGE: a new name is a new service"
        )
    if old.quorum_group_size != new.quorum_group_size:
        raise MigrationRefused(
            "CONSUMER_QUORUM_INITIAL_GROUP_SIZE differs: it is fixed at a queue's creation "
            "(rabbitmq-queues grow/shrink changes replicas)"
        )
    refusal = reshard_refusal(old, new)
    if refusal is not None:
        raise MigrationRefused(refusal)
    same_queue = old.names.work_version == new.names.work_version
    if not same_queue and max(old.shards, new.shards) > 1:
        # The move of an old generation knows one work queue: a shard's messages would stay.
        raise MigrationRefused(
            f"queue {new.names.queue} has shards = {max(old.shards, new.shards)}: a new "
            "work_queue_version of a sharded queue is not built"
        )
    if same_queue and old.delivery_limit != new.delivery_limit:
        raise MigrationRefused(
            f"CONSUMER_DELIVERY_LIMIT changes the arguments of {new.names.work}, which RabbitMQ "
            f"cannot change: set CONSUMER_WORK_QUEUE_VERSION={old.names.work_version + 1} "
            "for the new plan"
        )
    if same_queue and old.ack_timeout != new.ack_timeout:
        # RabbitMQ does not compare x-consumer-timeout when a queue is declared again: on the
        # existing work queue the new value would be accepted and never applied
        # (topology.broker_support), and the plans would look migrated.
        raise MigrationRefused(
            f"ack_timeout (CONSUMER_ACK_TIMEOUT) changes the arguments of {new.names.work}, which "
            f"RabbitMQ cannot change: set CONSUMER_WORK_QUEUE_VERSION="
            f"{old.names.work_version + 1} (a queue table's work_queue_version) for the new plan"
        )


def plan_migration(old: TopologySpec, new: TopologySpec) -> MigrationPlan:
    """The steps from the topology ``old`` describes to the one ``new`` does (none if equal)."""
    _check(old, new)
    names = new.names
    old_plan, new_plan = build_topology(old), build_topology(new)
    old_queues = {queue.name for queue in old_plan.queues}
    # The bindings of the shards that enter or leave are the reshard's, in an order of its own.
    resharded = set(old.work_queues) ^ set(new.work_queues) if old.shards != new.shards else set()
    reshard = plan_reshard(old, new)
    old_bindings = {_key(binding) for binding in old_plan.bindings}
    new_bindings = {_key(binding) for binding in new_plan.bindings}
    old_delays = {rung_label(delay): delay for delay in old.retry_delays}
    new_delays = {rung_label(delay): delay for delay in new.retry_delays}
    leaving = [old_delays[label] for label in old_delays if label not in new_delays]
    entering = [new_delays[label] for label in new_delays if label not in old_delays]

    steps: list[Step] = [Declare(q) for q in new_plan.queues if q.name not in old_queues]
    steps += [
        Bind(b)
        for b in new_plan.bindings
        if _key(b) not in old_bindings and b.queue not in resharded
    ]
    steps += reshard.binds
    # A migration back leaves the redirects of the one it undoes: an entering rung's label
    # must route to its own queue only.
    for delay in entering:
        target = nearest_rung(delay, old.retry_delays)
        if target is None:
            steps.append(Unbind(rung_binding(names.retry, names.redeliver, delay), True))
        else:
            steps.append(Unbind(rung_binding(names.retry, names.rung(target), delay)))
    moves: list[Step] = []
    for delay in leaving:
        target = nearest_rung(delay, new.retry_delays)
        if target is None:
            # No ladder left: an old replica's retry, and a waiting one, go straight back.
            steps.append(Bind(rung_binding(names.retry, names.redeliver, delay), True))
            moves.append(Move(names.rung(delay), names.redeliver, None, from_work=False))
        else:
            steps.append(Bind(rung_binding(names.retry, names.rung(target), delay)))
            moves.append(Move(names.rung(delay), names.retry, rung_label(target), from_work=False))
    steps += [
        Unbind(b)
        for b in old_plan.bindings
        if _key(b) not in new_bindings and b.queue not in resharded
    ]
    steps += reshard.unbinds
    steps += moves
    steps += reshard.moves
    old_work = old.names.work
    if old_work != names.work:
        steps.append(Move(old_work, names.redeliver, None, from_work=True))
    # Without consumers too: a reader holding a rung's messages unacked (`consumer events show`)
    # gives them back when it ends, and a queue deleted meanwhile would take them with it.
    steps += [Delete(names.rung(delay), unused=True) for delay in leaving]
    steps += reshard.deletes
    if old_work != names.work:
        steps.append(Delete(old_work, unused=True))
    return MigrationPlan(tuple(steps), reshard.absent)
