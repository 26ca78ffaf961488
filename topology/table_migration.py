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
queue's nearest rung (an old replica's retry is routed there too until it stops), and the emptied
queues are deleted. Its dead-letter queue and exchanges stay: they may hold dead letters to read.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from topology.migration_plan import (
    Bind,
    Declare,
    DeclareExchange,
    Delete,
    MigrationPlan,
    MigrationRefused,
    Move,
    Step,
    Unbind,
    nearest_rung,
    plan_migration,
    rung_binding,
)
from topology.model import Binding
from topology.names import rung_label
from topology.plan import TopologySpec, build_topology

__all__ = ["TableMigration", "TypeMove", "plan_table_migration"]

# Every binding before any unbinding: the order that routes a moving type twice, never nowhere.
_PHASES: tuple[type, ...] = (DeclareExchange, Declare, Bind, Unbind, Move, Delete)


@dataclass(frozen=True, slots=True)
class TypeMove:
    """An event type whose binding moves from one queue of the table to another."""

    event_type: str
    source: str
    """The queue it leaves (its name in the old table)."""
    target: str
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
            f"{self.event_type}: from queue {self.source} to queue {self.target} "
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


def _by_queue(specs: Sequence[TopologySpec], which: str) -> dict[str, TopologySpec]:
    queues: dict[str, TopologySpec] = {}
    for spec in specs:
        if spec.names.queue is None:
            raise MigrationRefused(
                f"the {which} plan has no queue table: a migration goes from one table to another"
            )
        if spec.shards > 1:
            # The steps know one work queue per queue: a shard's messages would be left behind.
            raise MigrationRefused(
                f"queue {spec.names.queue} has shards = {spec.shards} in the {which} table: "
                "migrating a sharded queue (resharding too) is not built yet"
            )
        queues[spec.names.queue] = spec
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
        assert before.names.queue is not None
        assert after.names.queue is not None
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


def _heir(leaving: TopologySpec, new: Sequence[TopologySpec]) -> TopologySpec:
    """The one queue of the ``new`` table that takes ``leaving``'s types (what it holds goes
    there)."""
    owners = _owners(new)
    heirs = {owners[t].names.queue: owners[t] for t in leaving.event_types if t in owners}
    if len(heirs) != 1:
        where = f"to {len(heirs)} queues ({', '.join(sorted(map(str, heirs)))})" if heirs else ""
        raise MigrationRefused(
            f"queue {leaving.names.queue} leaves the table and its types go {where or 'nowhere'}: "
            "what it holds can go to one queue only; migrate in steps (first move its types to "
            "one queue)"
        )
    return next(iter(heirs.values()))


def _redirect(leaving: Sequence[timedelta], retry: str, heir: TopologySpec) -> list[Bind]:
    """Each leaving rung's label, on the leaving queue's ``retry`` exchange, routed to the heir's
    nearest rung (or its redeliver exchange without a ladder)."""
    redirects = []
    for delay in leaving:
        target = nearest_rung(delay, heir.retry_delays)
        if target is None:
            redirects.append(Bind(rung_binding(retry, heir.names.redeliver, delay), True))
        else:
            redirects.append(Bind(rung_binding(retry, heir.names.rung(target), delay)))
    return redirects


def _leaving(old: TopologySpec, heir: TopologySpec) -> list[Step]:
    """A queue that leaves the table: routed to nowhere new, what it holds moved to its heir."""
    names = old.names
    steps: list[Step] = list(_redirect(old.retry_delays, names.retry, heir))
    steps += [Unbind(Binding(names.ingress, names.work, t)) for t in sorted(old.event_types)]
    for delay in old.retry_delays:
        target = nearest_rung(delay, heir.retry_delays)
        if target is None:
            steps.append(Move(names.rung(delay), heir.names.redeliver, None, from_work=False))
        else:
            steps.append(
                Move(names.rung(delay), heir.names.retry, rung_label(target), from_work=False)
            )
    steps.append(Move(names.work, heir.names.redeliver, None, from_work=True))
    steps += [Delete(names.rung(delay), unused=True) for delay in old.retry_delays]
    steps.append(Delete(names.work, unused=True))
    return steps


def _entering(new: TopologySpec, old: Sequence[TopologySpec]) -> list[Step]:
    """A queue new to the table: all of it declared and bound. When its types all come from one
    queue, the redirects a migration that removed it would have left there (this one rolls it
    back) are unbound, so that each of its retries goes to its own rung only."""
    plan = build_topology(new)
    steps: list[Step] = [DeclareExchange(e) for e in plan.exchanges if e.name != new.names.ingress]
    steps += [Declare(queue) for queue in plan.queues]
    steps += [Bind(binding) for binding in plan.bindings]
    owners = _owners(old)
    sources = {owners[t].names.queue: owners[t] for t in new.event_types if t in owners}
    if len(sources) == 1:
        (source,) = sources.values()
        redirects = _redirect(new.retry_delays, new.names.retry, source)
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
    for name, spec in after.items():
        if name in before:
            steps += plan_migration(before[name], spec).steps
        else:
            steps += _entering(spec, old)
    for name, spec in before.items():
        if name not in after:
            steps += _leaving(spec, _heir(spec, new))
    # A stable sort: each queue's own steps keep their order within a phase.
    steps.sort(key=lambda step: _PHASES.index(type(step)))
    return TableMigration(MigrationPlan(tuple(steps)), _moves(old, new))
