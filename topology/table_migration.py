"""From one queue table's plan to another's: ``consumer topology migrate`` with a queue table.

Each queue of both tables migrates as a service without a table does
(:func:`~topology.migration_plan.plan_migration`: its ladder, delivery limit, work queue
generation, and its event types' bindings). An event type that moves from queue ``a`` to queue
``b`` is, in those two plans, a binding ``b`` gains and one ``a`` loses; the steps of every queue
are merged phase by phase, so that every binding is made before any is removed:

1. declare what is new (a queue new to the table: its exchanges, queues and bindings);
2. bind: from here on a moving type is routed to both work queues (the receipts, one table for
   every queue, make the second copy a duplicate);
3. unbind: from here on it is routed to its new queue only;
4. move what queues leaving the plan hold (an old generation, a leaving rung, a queue leaving
   the table), then delete them once empty and unconsumed.

What the old queue already holds of a moving type is **not** moved: the old queue stays in the
table, so its consumers keep taking it, and every queue's service holds every handler (one
``CONSUMER_HANDLERS``), so they apply it, and what its retry ladder holds comes back to it and is
applied there too. This is what RabbitMQ users do to re-route a kind of message (bind the new
queue, unbind the old, let the old drain): a queue cannot be read by type, so moving only one
type would mean taking every message of the old queue away from its own consumers, putting the
others back (out of order, twice the traffic), and, under load, never being done. Nothing waits
in the old queue for anyone else to take it, so nothing is stranded; a straggler is applied under
the old queue's settings (its prefetch, time limits and ladder), once.

A queue that leaves the table has no consumers left, so what it holds is moved: its work queue
through the redeliver exchange of the one queue that takes its types now, each rung into that
queue's nearest rung (an old replica's retry is routed there instead until it stops), and the
emptied queues are deleted. Its dead-letter queue and exchanges stay: they may hold dead letters
to read.

A service without a table is a table of one queue (``names.queue`` is ``None``: today's names),
so a migration to a table and back is one of these too. Its queue is the one allowed to leave
for several queues: a table shares its types among them. What it holds is then moved type by
type (each message by its routing key, the event type it was published with) to the queue that
takes the type now, and an old replica's retry is routed by the routing key it first came with
(:data:`~topology.names.ORIGINAL_ROUTING_KEY`, which every retry copy carries). A table's queue
that leaves for several is still refused: it can be migrated in steps (its types first moved to
one queue), which a service without a table cannot.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from topology.migration_plan import MigrationRefused, nearest_rung, plan_migration, rung_binding
from topology.model import Binding
from topology.names import ORIGINAL_ROUTING_KEY, rung_label
from topology.plan import TopologySpec, build_topology
from topology.steps import (
    Bind,
    Declare,
    DeclareExchange,
    Delete,
    MigrationPlan,
    Move,
    Route,
    Step,
    Unbind,
)

__all__ = ["TableMigration", "TypeMove", "plan_table_migration"]

# Every binding before any unbinding: the order that routes a moving type twice, never nowhere.
_PHASES: tuple[type, ...] = (DeclareExchange, Declare, Bind, Unbind, Move, Delete)


def _queue(name: str | None) -> str:
    return "the service without a table" if name is None else f"queue {name}"


@dataclass(frozen=True, slots=True)
class TypeMove:
    """An event type whose binding moves from one queue of the table to another."""

    event_type: str
    source: str | None
    """The queue it leaves (its name in the old table; ``None``: the service had no table)."""
    target: str | None
    source_work: str
    target_work: str
    drained: bool
    """True when the source stays in the table: its consumers apply what it holds of the type;
    false when it leaves the table, and what it holds is moved."""

    def describe(self) -> str:
        rest = (
            f"{self.source_work}'s consumers apply what it already holds of it"
            if self.drained
            else f"what {self.source_work} holds is moved"
        )
        return (
            f"{self.event_type}: from {_queue(self.source)} to {_queue(self.target)} "
            f"({self.target_work}); {rest}"
        )


@dataclass(frozen=True, slots=True)
class TableMigration:
    plan: MigrationPlan
    moved: tuple[TypeMove, ...]

    @property
    def changes_nothing(self) -> bool:
        return self.plan.changes_nothing

    def describe(self) -> list[str]:
        """What ``--dry-run`` prints: the types that move, then the numbered steps."""
        return [f"moves {move.describe()}" for move in self.moved] + self.plan.describe()


def _by_queue(specs: Sequence[TopologySpec], which: str) -> dict[str | None, TopologySpec]:
    """Each queue's plan by its name; the service without a table is one queue named ``None``."""
    queues = {spec.names.queue: spec for spec in specs}
    if None in queues and len(specs) > 1:
        raise MigrationRefused(
            f"the {which} plan mixes the queue of a service without a table with a table's "
            "queues: it is one or the other"
        )
    return queues


def _owners(specs: Sequence[TopologySpec]) -> dict[str, TopologySpec]:
    return {event_type: spec for spec in specs for event_type in spec.event_types}


def _moves(old: Sequence[TopologySpec], new: Sequence[TopologySpec]) -> tuple[TypeMove, ...]:
    """Each type both tables route, to another queue in the new one."""
    now = _owners(new)
    staying = {spec.names.queue for spec in new}
    moves = []
    for event_type, before in sorted(_owners(old).items()):
        after = now.get(event_type)
        if after is None or after.names.queue == before.names.queue:
            continue
        moves.append(
            TypeMove(
                event_type,
                before.names.queue,
                after.names.queue,
                before.names.work,
                after.names.work,
                drained=before.names.queue in staying,
            )
        )
    return tuple(moves)


@dataclass(frozen=True, slots=True)
class _Heirs:
    """Where what a leaving queue holds goes: to ``heir``, or, when its types go to several
    queues (only a service without a table's do), to the queue ``by_type`` gives each type."""

    heir: TopologySpec
    by_type: tuple[tuple[str, TopologySpec], ...] = ()

    @property
    def others(self) -> tuple[tuple[str, TopologySpec], ...]:
        """The types that go to another queue than ``heir``, with it."""
        return tuple((t, spec) for t, spec in self.by_type if spec is not self.heir)


def _heirs(leaving: TopologySpec, new: Sequence[TopologySpec]) -> _Heirs:
    """The queues of the ``new`` table that take ``leaving``'s types: one, unless ``leaving`` is
    the queue of a service without a table. Its heir then is the queue that takes most of its
    types (the first of the table on a tie), and each type goes to its own queue."""
    owners = _owners(new)
    taken = {t: owners[t] for t in sorted(leaving.event_types) if t in owners}
    heirs = {spec.names.queue: spec for spec in taken.values()}
    if len(heirs) == 1:
        return _Heirs(next(iter(heirs.values())))
    if leaving.names.queue is not None or not heirs:
        where = f"to {len(heirs)} queues ({', '.join(sorted(map(str, heirs)))})" if heirs else ""
        raise MigrationRefused(
            f"{_queue(leaving.names.queue)} leaves the table and its types go "
            f"{where or 'nowhere'}: what it holds can go to one queue only; migrate in steps "
            "(first move its types to one queue)"
        )
    order = [spec.names.queue for spec in new]
    counts = {name: sum(spec is heirs[name] for spec in taken.values()) for name in heirs}
    first = min(heirs, key=lambda name: (-counts[name], order.index(name)))
    return _Heirs(heirs[first], tuple(taken.items()))


def _redirects(leaving: TopologySpec, heirs: _Heirs) -> list[Bind]:
    """Each leaving rung's label, on the leaving queue's retry exchange, routed to the heir's
    nearest rung (or its redeliver exchange without a ladder): an old replica's retries. Shared
    among several heirs, each type's binding also matches the routing key its retries carry."""
    pairs: list[tuple[str | None, TopologySpec]] = [*heirs.by_type] or [(None, heirs.heir)]
    redirects = []
    for delay in leaving.retry_delays:
        for event_type, heir in pairs:
            target = nearest_rung(delay, heir.retry_delays)
            queue = heir.names.redeliver if target is None else heir.names.rung(target)
            binding = rung_binding(leaving.names.retry, queue, delay)
            if event_type is not None:
                arguments = {**binding.arguments, ORIGINAL_ROUTING_KEY: event_type}
                binding = Binding(binding.exchange, queue, arguments=arguments)
            redirects.append(Bind(binding, to_exchange=target is None))
    return redirects


def _rung_of(delay: timedelta, heir: TopologySpec) -> tuple[str, str | None]:
    """The exchange and rung label a retry waiting ``delay`` goes to in ``heir``: its nearest
    rung, or (no ladder) straight back through its redeliver exchange."""
    target = nearest_rung(delay, heir.retry_delays)
    if target is None:
        return heir.names.redeliver, None
    return heir.names.retry, rung_label(target)


def _move(source: str, heirs: _Heirs, delay: timedelta | None) -> Move:
    """``source``'s messages to their heirs: a rung's (``delay``) into the heirs' nearest rungs,
    a work queue's through the heirs' redeliver exchanges."""

    def to(heir: TopologySpec) -> tuple[str, str | None]:
        return (heir.names.redeliver, None) if delay is None else _rung_of(delay, heir)

    routes = tuple(Route(event_type, *to(heir)) for event_type, heir in heirs.others)
    return Move(source, *to(heirs.heir), from_work=delay is None, routes=routes)


def _leaving(old: TopologySpec, heirs: _Heirs) -> list[Step]:
    """A queue that leaves the table: routed to nowhere new, what it holds moved to its heirs."""
    names = old.names
    steps: list[Step] = list(_redirects(old, heirs))
    steps += [Unbind(Binding(names.ingress, names.work, t)) for t in sorted(old.event_types)]
    # Its own rungs' bindings too (after the redirects, a phase later): an old replica's retry
    # routed to both its old rung and its heir's would be two copies in the ladders, each run,
    # and each dead-lettered once its attempts run out.
    steps += [Unbind(rung_binding(names.retry, names.rung(d), d)) for d in old.retry_delays]
    steps += [_move(names.rung(delay), heirs, delay) for delay in old.retry_delays]
    steps.append(_move(names.work, heirs, None))
    steps += [Delete(names.rung(delay), unused=True) for delay in old.retry_delays]
    steps.append(Delete(names.work, unused=True))
    return steps


def _entering(new: TopologySpec, old: Sequence[TopologySpec]) -> list[Step]:
    """A queue new to the table: all of it declared and bound. When its types all come from one
    queue (or it is the queue of a service without a table), the redirects a migration that
    removed it would have left (this one rolls it back) are unbound, so that each of its
    retries goes to its own rung only."""
    plan = build_topology(new)
    steps: list[Step] = [DeclareExchange(e) for e in plan.exchanges if e.name != new.names.ingress]
    steps += [Declare(queue) for queue in plan.queues]
    steps += [Bind(binding) for binding in plan.bindings]
    owners = _owners(old)
    sources = {owners[t].names.queue for t in new.event_types if t in owners}
    if len(sources) == 1 or (sources and new.names.queue is None):
        redirects = _redirects(new, _heirs(new, old))
        steps += [Unbind(redirect.binding, redirect.to_exchange) for redirect in redirects]
    return steps


def plan_table_migration(
    old: Sequence[TopologySpec], new: Sequence[TopologySpec]
) -> TableMigration:
    """The steps from the plan of the queue table ``old`` (one spec per queue) to that of ``new``,
    and the event types that change queues. Pure: no broker."""
    before, after = _by_queue(old, "old"), _by_queue(new, "new")
    services = {(spec.names.service, spec.names.ingress) for spec in (*old, *new)}
    if len(services) > 1:
        raise MigrationRefused(
            "a migration keeps CONSUMER_NAME and CONSUMER_EXCHANGE: a new name is a new service"
        )
    steps: list[Step] = []
    absent: list[str] = []
    for name, spec in after.items():
        if name in before:
            plan = plan_migration(before[name], spec)
            steps += plan.steps
            absent += plan.absent
        else:
            steps += _entering(spec, old)
    for name, spec in before.items():
        if name not in after:
            if spec.shards > 1:
                # Its leaving moves one work queue: the shards' messages would be left behind.
                raise MigrationRefused(
                    f"queue {name} has shards = {spec.shards} and leaves the table: not built; "
                    "keep it in the table until its shards are drained"
                )
            heirs = _heirs(spec, new)
            sharded = sorted(
                {
                    str(h.names.queue)
                    for h in (heirs.heir, *dict(heirs.by_type).values())
                    if h.shards > 1
                }
            )
            if sharded:
                # Its messages and retries would reach a sharded queue's redeliver exchange with
                # no shard to return to, and be dropped there.
                raise MigrationRefused(
                    f"{_queue(name)} leaves the table for sharded queue {', '.join(sharded)}: "
                    "not built; keep it in the table"
                )
            steps += _leaving(spec, heirs)
    # A stable sort: each queue's own steps keep their order within a phase.
    steps.sort(key=lambda step: _PHASES.index(type(step)))
    return TableMigration(MigrationPlan(tuple(steps), tuple(absent)), _moves(old, new))
