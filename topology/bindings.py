"""The bindings on the broker compared with the plan's.

AMQP can declare a binding but never list one (nor can a probe tell one is there without routing
a message through it), so ``consumer topology check`` reads them from RabbitMQ's management HTTP
API (``GET /api/bindings/<vhost>``, :mod:`topology.management`). The comparison is pure:
:func:`compare_bindings`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from topology.management import get_json
from topology.model import Binding, ExchangeType, Topology
from topology.names import SHARD

__all__ = ["BindingDifferences", "compare_bindings", "read_bindings"]


@dataclass(frozen=True, slots=True)
class BindingDifferences:
    """What the broker's bindings lack of the plan, and what it binds to the plan's queues that
    the plan does not (a type moved to another queue, still routed to the old one)."""

    missing: tuple[Binding, ...] = ()
    unplanned: tuple[Binding, ...] = ()

    def describe(self) -> list[str]:
        return [f"missing: {binding.describe()}" for binding in self.missing] + [
            f"not in the plan: {binding.describe()}" for binding in self.unplanned
        ]


def _key(binding: Binding) -> tuple[str, str, str, tuple[tuple[str, str], ...], bool]:
    arguments = tuple(sorted((str(k), str(v)) for k, v in binding.arguments.items()))
    return binding.exchange, binding.queue, binding.routing_key, arguments, binding.to_exchange


def _shard_labels(plan: Topology) -> dict[tuple[str, str], set[str]]:
    """Each sharded queue's (redeliver exchange, hash exchange), paired by the shards both are
    bound to, with the labels of its own shards: another queue's are not its."""
    hashes = {b.queue: b.exchange for b in plan.bindings if b.exchange in _hashing(plan)}
    labels: dict[tuple[str, str], set[str]] = {}
    for binding in plan.bindings:
        label = binding.arguments.get(SHARD)
        if label is not None and not binding.to_exchange and binding.queue in hashes:
            pair = (binding.exchange, hashes[binding.queue])
            labels.setdefault(pair, set()).add(str(label))
    return labels


def _hashing(plan: Topology) -> set[str]:
    return {e.name for e in plan.exchanges if e.type is ExchangeType.CONSISTENT_HASH}


def _retired_shard(binding: Binding, labels: dict[tuple[str, str], set[str]]) -> bool:
    """A redeliver exchange's binding to its own queue's hash exchange on a shard label that
    queue has not: a migration to fewer shards left it, so that a retry of a removed shard is
    hashed by its key (:mod:`topology.reshard`). It routes nothing the queue's shards are
    stamped with."""
    label = binding.arguments.get(SHARD)
    own = labels.get((binding.exchange, binding.queue))
    return binding.to_exchange and own is not None and label is not None and str(label) not in own


def compare_bindings(plan: Topology, present: Iterable[Binding]) -> BindingDifferences:
    """The plan's bindings the broker lacks, and the broker's bindings from one of the plan's
    exchanges to one of its queues (or exchanges), or from one of its hash exchanges to
    anything, that the plan has not."""
    present = list(present)
    have = {_key(binding) for binding in present}
    wanted = {_key(binding) for binding in plan.bindings}
    exchanges = {exchange.name for exchange in plan.exchanges}
    queues = {queue.name for queue in plan.queues}
    # A hash exchange is the service's alone, and whatever it is bound to takes a share of the
    # keys: a shard the plan has not (a table whose shards went down) counts too.
    hashing = _hashing(plan)
    missing = tuple(b for b in plan.bindings if _key(b) not in have)
    labels = _shard_labels(plan)
    unplanned = tuple(
        b
        for b in present
        if b.exchange in exchanges
        and (b.exchange in hashing or b.queue in (exchanges if b.to_exchange else queues))
        and _key(b) not in wanted
        and not _retired_shard(b, labels)
    )
    return BindingDifferences(missing, unplanned)


def _binding(row: Mapping[str, Any]) -> Binding | None:
    # The default exchange's implicit bindings ("") are not ours.
    kind = row.get("destination_type")
    if not row.get("source") or kind not in ("queue", "exchange"):
        return None
    return Binding(
        str(row["source"]),
        str(row["destination"]),
        str(row.get("routing_key", "")),
        dict(row.get("arguments") or {}),
        to_exchange=kind == "exchange",
    )


async def read_bindings(management_url: str, vhost: str) -> list[Binding]:
    """Every binding of ``vhost`` to a queue or an exchange, from the management API at
    ``management_url`` (``http://user:password@host:15672``)."""
    rows = await get_json(management_url, f"bindings/{quote(vhost, safe='')}")
    return [binding for row in rows if (binding := _binding(row)) is not None]
