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
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from datetime import timedelta

from topology.model import Binding, Exchange, Queue
from topology.names import RETRY_RUNG, rung_label
from topology.plan import TopologySpec, build_topology

__all__ = [
    "Bind",
    "Declare",
    "DeclareExchange",
    "Delete",
    "MigrationPlan",
    "MigrationRefused",
    "Move",
    "Route",
    "Step",
    "Unbind",
    "nearest_rung",
    "plan_migration",
    "rung_binding",
]


class MigrationRefused(ValueError):
    """The two plans cannot be migrated between (the message says which setting to change)."""


@dataclass(frozen=True, slots=True)
class DeclareExchange:
    """An exchange of a queue new to a queue table (:mod:`topology.table_migration`)."""

    exchange: Exchange

    def describe(self) -> str:
        return f"declare {self.exchange.describe()}"


@dataclass(frozen=True, slots=True)
class Declare:
    queue: Queue

    def describe(self) -> str:
        return f"declare {self.queue.describe()}"


@dataclass(frozen=True, slots=True)
class Bind:
    """A binding to a queue, or (``to_exchange``) to an exchange: ``binding.queue`` names it."""

    binding: Binding
    to_exchange: bool = False

    def describe(self) -> str:
        return self.binding.describe() + (" (exchange)" if self.to_exchange else "")


@dataclass(frozen=True, slots=True)
class Unbind:
    binding: Binding
    to_exchange: bool = False

    def describe(self) -> str:
        return "un" + self.binding.describe() + (" (exchange)" if self.to_exchange else "")


def _to(exchange: str, rung: str | None) -> str:
    return f"rung {rung} through {exchange}" if rung else f"exchange {exchange}"


@dataclass(frozen=True, slots=True)
class Route:
    """Where a :class:`Move` sends the messages of one event type (their routing key) instead."""

    event_type: str
    exchange: str
    rung: str | None

    def describe(self) -> str:
        return f"{self.event_type} to {_to(self.exchange, self.rung)}"


@dataclass(frozen=True, slots=True)
class Move:
    """Every message of ``source`` to ``exchange``, each copy confirmed before its original is
    acked, with its own routing key, and the header :data:`~topology.names.RETRY_RUNG` set to
    ``rung`` when given (the retry exchange routes on it). ``from_work``: the source is a work
    queue, whose messages are not all the service's own (see :mod:`topology.migrate`).
    ``routes``: the event types that go elsewhere, picked by routing key (the queue of a service
    without a table, whose types a queue table shares among several queues).

    Never through the default exchange: the least-privileged bootstrap user may write only to
    the service's own exchanges."""

    source: str
    exchange: str
    rung: str | None
    from_work: bool
    routes: tuple[Route, ...] = ()

    def destination(self, routing_key: str) -> tuple[str, str | None]:
        """The exchange and rung a message with ``routing_key`` goes to."""
        for route in self.routes:
            if route.event_type == routing_key:
                return route.exchange, route.rung
        return self.exchange, self.rung

    @property
    def exchanges(self) -> tuple[str, ...]:
        """Every exchange this move may publish to."""
        return tuple(dict.fromkeys([self.exchange, *(route.exchange for route in self.routes)]))

    def describe(self) -> str:
        if not self.routes:
            return f"move the messages of {self.source} to {_to(self.exchange, self.rung)}"
        routes = ", ".join(route.describe() for route in self.routes)
        return (
            f"move the messages of {self.source} by event type: {routes}, the rest to "
            f"{_to(self.exchange, self.rung)}"
        )


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete a queue once it holds nothing; ``unused``: and no one consumes it."""

    queue: str
    unused: bool

    def describe(self) -> str:
        when = "empty and without consumers" if self.unused else "empty"
        return f"delete queue {self.queue} once {when}"


Step = DeclareExchange | Declare | Bind | Unbind | Move | Delete


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    steps: tuple[Step, ...]

    @property
    def changes_nothing(self) -> bool:
        return not self.steps

    def describe(self) -> list[str]:
        """One numbered line per step, as ``--dry-run`` prints them."""
        return [f"{number:>2}. {step.describe()}" for number, step in enumerate(self.steps, 1)]


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
    same_queue = old.names.work_version == new.names.work_version
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
    old_bindings = {_key(binding) for binding in old_plan.bindings}
    new_bindings = {_key(binding) for binding in new_plan.bindings}
    old_delays = {rung_label(delay): delay for delay in old.retry_delays}
    new_delays = {rung_label(delay): delay for delay in new.retry_delays}
    leaving = [old_delays[label] for label in old_delays if label not in new_delays]
    entering = [new_delays[label] for label in new_delays if label not in old_delays]

    steps: list[Step] = [Declare(q) for q in new_plan.queues if q.name not in old_queues]
    steps += [Bind(b) for b in new_plan.bindings if _key(b) not in old_bindings]
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
    steps += [Unbind(b) for b in old_plan.bindings if _key(b) not in new_bindings]
    steps += moves
    old_work = old.names.work
    if old_work != names.work:
        steps.append(Move(old_work, names.redeliver, None, from_work=True))
    # Without consumers too: a reader holding a rung's messages unacked (`consumer events show`)
    # gives them back when it ends, and a queue deleted meanwhile would take them with it.
    steps += [Delete(names.rung(delay), unused=True) for delay in leaving]
    if old_work != names.work:
        steps.append(Delete(old_work, unused=True))
    return MigrationPlan(tuple(steps))
