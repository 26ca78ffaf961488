"""Resharding: the steps that take a sharded queue from N shards to M (both 2 or more), as data.

The hash exchange (``x-consistent-hash``) numbers one bucket per weight-1 binding, in the order
they were made, and picks a key's bucket by jump consistent hashing over their count (the
plugin's ``rabbit_exchange_type_consistent_hash``): a binding added last takes a share of every
other bucket's keys and moves no key between the others; the binding removed last gives its keys
to the others and moves nothing else; a binding removed from the middle renumbers those after it.
So shards are added after the last and removed from the last down, ``s<N>`` first.

More shards (N -> M):

1. declare ``work.s<N+1>`` ... ``work.s<M>``;
2. bind the redeliver exchange to each (``consumer-shard: s<k>``: its retries come back to it),
   then the hash exchange to each, in order: from then on the new shards take their keys;
3. unbind what a migration to fewer shards left for those labels (below).

Nothing moves: the old shards stay, their consumers apply what they hold. A key that moved has its
older events in its old shard and its newer ones in its new shard until the old one is drained.

Fewer shards (N -> M):

1. bind the redeliver exchange, for each leaving label ``s<k>``, to the hash exchange: a retry
   copy of a leaving shard (an old replica's, or one waiting in a rung) is hashed by its key to
   the shard the key has now, not dropped at the end of its rung for want of a binding;
2. unbind the hash exchange from the leaving shards, the last first: from then on their keys go
   to the staying shards, whose own keys stay where they were;
3. unbind the redeliver exchange from the leaving shards;
4. move what each leaving shard holds through the redeliver exchange, as ``consumer-shard:
   s<k>`` (its own label: the binding of step 1 re-hashes it by its ``consumer-shard-key``, which
   it keeps); the consuming service stamps the shard it arrives in. Through the redeliver
   exchange, not the hash exchange, because the service trusts the headers of what comes from
   its own redeliver exchange only: a retry keeps its attempt count;
5. delete each leaving shard once empty and unconsumed (an old replica still consuming it: wait).

The bindings of step 1 stay: a retry of a leaving shard may wait in a rung for as long as the
ladder's longest delay, and the migration cannot see the rungs' headers. They route only a header
no shard of the queue has; ``consumer topology check`` does not count them against the plan, and
``consumer topology apply`` of a table that has the shard again removes its redirect.

A queue of one shard is the unsharded work queue, whose redeliver exchange is a fanout exchange,
not a headers one: RabbitMQ cannot change an exchange's type, so 1 -> N and N -> 1 are refused.
"""

from __future__ import annotations

from dataclasses import dataclass

from topology.model import Binding
from topology.names import SHARD, shard_label
from topology.plan import SHARD_WEIGHT, TopologySpec, shard_redirect
from topology.steps import Bind, Delete, Move, Unbind

__all__ = ["Reshard", "plan_reshard", "redirect_binding", "reshard_refusal"]


def redirect_binding(spec: TopologySpec, shard: int) -> Binding:
    """The redeliver exchange's binding that sends a retry of ``shard`` (one the queue no longer
    has) to the hash exchange, to be hashed by its key."""
    return shard_redirect(spec.names, shard)


def _return_binding(spec: TopologySpec, shard: int) -> Binding:
    names = spec.names
    arguments = {"x-match": "all", SHARD: shard_label(shard)}
    return Binding(names.redeliver, names.shard(shard), arguments=arguments)


def _hash_binding(spec: TopologySpec, shard: int) -> Binding:
    return Binding(spec.names.hash, spec.names.shard(shard), SHARD_WEIGHT)


@dataclass(frozen=True, slots=True)
class Reshard:
    """A queue's steps from its old shard count to its new one, by phase (the migration plan
    puts each among the steps of its kind)."""

    binds: tuple[Bind, ...] = ()
    unbinds: tuple[Unbind, ...] = ()
    moves: tuple[Move, ...] = ()
    deletes: tuple[Delete, ...] = ()
    absent: tuple[str, ...] = ()
    """The shard beyond the larger of the two counts: on the broker, the install has more shards
    than the tables say (a migration to fewer shards not finished, a wrong old table), and the
    steps would leave that shard bound to the hash exchange, taking keys no replica consumes."""


def reshard_refusal(old: TopologySpec, new: TopologySpec) -> str | None:
    """Why the shard counts of ``old`` and ``new`` cannot be migrated between, or None."""
    if old.shards == new.shards:
        return None
    where = f"queue {new.names.queue}" if new.names.queue is not None else "the work queue"
    if 1 in (old.shards, new.shards):
        return (
            f"{where}: from shards = {old.shards} to {new.shards} is not built: an unsharded "
            "queue's redeliver exchange is fanout, a sharded one's headers, and RabbitMQ cannot "
            "change an exchange's type; reshard between 2 or more shards"
        )
    if old.names.work_version != new.names.work_version:
        return (
            f"{where}: a new shard count and a new work_queue_version at once: migrate one, "
            "then the other"
        )
    return None


def plan_reshard(old: TopologySpec, new: TopologySpec) -> Reshard:
    """The steps from ``old.shards`` to ``new.shards`` (both 2 or more, or equal: none)."""
    if old.shards == new.shards:
        return Reshard()
    if old.shards < new.shards:
        entering = range(old.shards + 1, new.shards + 1)
        binds = [
            Bind(binding)
            for shard in entering
            for binding in (_return_binding(new, shard), _hash_binding(new, shard))
        ]
        # What a migration to fewer shards left: a retry of the shard must come back to it only.
        unbinds = [Unbind(redirect_binding(new, shard), to_exchange=True) for shard in entering]
        return Reshard(binds=tuple(binds), unbinds=tuple(unbinds), absent=_beyond(new))
    leaving = range(old.shards, new.shards, -1)  # the last first
    names = old.names
    return Reshard(
        binds=tuple(Bind(redirect_binding(old, shard), to_exchange=True) for shard in leaving),
        unbinds=(
            *(Unbind(_hash_binding(old, shard)) for shard in leaving),
            *(Unbind(_return_binding(old, shard)) for shard in leaving),
        ),
        moves=tuple(
            Move(names.shard(s), names.redeliver, None, from_work=True, shard=shard_label(s))
            for s in leaving
        ),
        deletes=tuple(Delete(names.shard(shard), unused=True) for shard in leaving),
        absent=_beyond(old),
    )


def _beyond(spec: TopologySpec) -> tuple[str, ...]:
    # Not the shards between the two counts: a rollback of a migration to fewer shards that
    # stopped half-way finds them there, and binds them back.
    return () if spec.shard_beyond is None else (spec.shard_beyond,)
