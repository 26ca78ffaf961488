"""The topology of one service: what ``consumer topology apply`` declares, as data.

::

    producers -> [ingress] (topic) --rk = type--> (work) quorum, dead-letter -> [dlx]
    failed event: publish -> [retry] (headers: rung) -> (retry.<delay>) x-message-ttl
                                     expiry, dead-lettered -> [redeliver] (fanout) -> (work)
    poison, delivery limit, published dead letters -> [dlx] (fanout) -> (dead)

A sharded queue (``shards`` > 1) has N work queues, ``work.s1`` ... ``work.sN``, in place of one::

    [ingress] --rk = type--> [hash] (x-consistent-hash on the consumer-shard-key header)
                               --weight 1--> (work.s1) ... (work.sN)   leaders balanced over nodes
    (retry.<delay>) expiry, dead-lettered -> [redeliver] (headers: consumer-shard = s<i>)
                                               -> (work.s<i>)

Each key goes to one shard; a retry copy carries the shard it came from, and its rung returns it
there. The ladder and the dead-letter queue stay one per queue.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from topology.broker_support import CONSUMER_TIMEOUT
from topology.durations import to_milliseconds
from topology.model import Binding, Exchange, ExchangeType, Queue, QueueType, Topology
from topology.names import RETRY_RUNG, SHARD, SHARD_KEY, Names, rung_label, shard_label

__all__ = [
    "DEAD_QUEUE_DELIVERY_LIMIT",
    "LEADER_LOCATOR",
    "MAX_SHARDS",
    "SHARD_WEIGHT",
    "TopologySpec",
    "build_topology",
    "shard_redirect",
]

# Dead-lettering out of a quorum queue is lossless only with at-least-once, which needs
# reject-publish overflow (RabbitMQ 3.10 and later).
_LOSSLESS_DEAD_LETTERING: dict[str, Any] = {
    "x-dead-letter-strategy": "at-least-once",
    "x-overflow": "reject-publish",
}

# Browsing the dead-letter queue returns what it read, which counts as a delivery. RabbitMQ 4
# gives quorum queues a delivery limit of 20 by default and would drop an often-inspected dead
# letter; an explicit, unreachable limit keeps it on every version (3.10 has no "unlimited").
DEAD_QUEUE_DELIVERY_LIMIT = 1_000_000

MAX_SHARDS = 64
"""The most shards one queue may have."""

SHARD_WEIGHT = "1"
"""Each shard's binding to the hash exchange: its routing key is its weight, equal for all."""

LEADER_LOCATOR = {"x-queue-leader-locator": "balanced"}
"""Where a new shard's leader goes: the node with the fewest quorum queue leaders (RabbitMQ 3.10
and later), so that N shards declared in a row land on different nodes of a cluster."""


@dataclass(frozen=True, slots=True)
class TopologySpec:
    """What the plan depends on: the service's names, its retry ladder, its delivery limit and
    the event types its handlers take."""

    names: Names
    retry_delays: Sequence[timedelta]
    delivery_limit: int
    event_types: Iterable[str]
    quorum_group_size: int | None = None
    """How many nodes hold each queue's replicas when it is created; ``None``: the broker's
    default. Fixed at creation: RabbitMQ refuses a different value for an existing queue."""
    ack_timeout: timedelta | None = None
    """The work queue's delivery acknowledgement timeout (``x-consumer-timeout``, RabbitMQ 3.12
    and later: :mod:`topology.broker_support`); ``None``: the broker's ``consumer_timeout``."""
    shards: int = 1
    """How many work queues share the queue's events, by key (1: the one work queue)."""

    def __post_init__(self) -> None:
        if not 1 <= self.shards <= MAX_SHARDS:
            raise ValueError(f"shards must be 1 to {MAX_SHARDS}, not {self.shards}")

    @property
    def work_queues(self) -> tuple[str, ...]:
        """The queues the service consumes: the work queue, or each shard."""
        if self.shards == 1:
            return (self.names.work,)
        return tuple(self.names.shard(shard) for shard in range(1, self.shards + 1))

    @property
    def shard_beyond(self) -> str | None:
        """The shard queue after a sharded queue's last: on the broker, it says the queue was
        made with more shards, and the hash exchange may still send it keys."""
        if self.shards == 1 or self.shards == MAX_SHARDS:
            return None
        return self.names.shard(self.shards + 1)


def build_topology(spec: TopologySpec) -> Topology:
    """The full plan for one service."""
    names = spec.names
    sharded = spec.shards > 1
    replicas: dict[str, Any] = {}
    if spec.quorum_group_size is not None:
        replicas["x-quorum-initial-group-size"] = spec.quorum_group_size
    exchanges = (
        Exchange(names.ingress, ExchangeType.TOPIC),
        Exchange(names.dlx, ExchangeType.FANOUT),
        Exchange(names.retry, ExchangeType.HEADERS),
        Exchange(names.redeliver, ExchangeType.HEADERS if sharded else ExchangeType.FANOUT),
        *(
            (
                Exchange(
                    names.hash, ExchangeType.CONSISTENT_HASH, arguments={"hash-header": SHARD_KEY}
                ),
            )
            if sharded
            else ()
        ),
    )
    acknowledgement: dict[str, Any] = {}
    if spec.ack_timeout is not None:
        acknowledgement[CONSUMER_TIMEOUT] = to_milliseconds(spec.ack_timeout)
    work_arguments = {
        "x-dead-letter-exchange": names.dlx,
        "x-delivery-limit": spec.delivery_limit,
        **_LOSSLESS_DEAD_LETTERING,
        **replicas,
        **acknowledgement,
        **(LEADER_LOCATOR if sharded else {}),
    }
    work = tuple(Queue(name, QueueType.QUORUM, work_arguments) for name in spec.work_queues)
    dead = Queue(
        names.dead, QueueType.QUORUM, {"x-delivery-limit": DEAD_QUEUE_DELIVERY_LIMIT, **replicas}
    )
    rungs = tuple(
        Queue(
            names.rung(delay),
            QueueType.QUORUM,
            {
                "x-message-ttl": to_milliseconds(delay),
                "x-dead-letter-exchange": names.redeliver,
                **_LOSSLESS_DEAD_LETTERING,
                **replicas,
            },
        )
        for delay in spec.retry_delays
    )
    bindings = (
        *(_routes(spec) if sharded else _one_queue_routes(spec)),
        Binding(names.dlx, names.dead),
        *(
            Binding(
                names.retry,
                names.rung(delay),
                arguments={"x-match": "all", RETRY_RUNG: rung_label(delay)},
            )
            for delay in spec.retry_delays
        ),
    )
    # A migration to fewer shards routed a removed shard's retries to the hash exchange: a shard
    # of this plan with that label must have its retries back alone, not hashed as well.
    unbindings = tuple(shard_redirect(names, shard) for shard in range(1, spec.shards + 1))
    return Topology(
        exchanges=exchanges,
        queues=(dead, *work, *rungs),
        bindings=bindings,
        unbindings=unbindings if sharded else (),
    )


def shard_redirect(names: Names, shard: int) -> Binding:
    """The redeliver exchange's binding that sends a retry of ``shard`` to the hash exchange, to
    be hashed by its key: made by a migration to fewer shards for each shard it removes
    (:mod:`topology.reshard`), removed by one that adds the shard back, and by ``apply``."""
    arguments = {"x-match": "all", SHARD: shard_label(shard)}
    return Binding(names.redeliver, names.hash, arguments=arguments, to_exchange=True)


def _one_queue_routes(spec: TopologySpec) -> tuple[Binding, ...]:
    """Each type from the ingress to the work queue, and every expired retry back to it."""
    names = spec.names
    return (
        *(
            Binding(names.ingress, names.work, event_type)
            for event_type in sorted(spec.event_types)
        ),
        Binding(names.redeliver, names.work),
    )


def _routes(spec: TopologySpec) -> tuple[Binding, ...]:
    """From the hash exchange to every shard with the same weight, then each type from the
    ingress to the hash exchange; an expired retry back to the shard its :data:`SHARD` header
    names."""
    names = spec.names
    shards = range(1, spec.shards + 1)
    return (
        # Bound in this order by apply: a type routed to a hash exchange with no shard yet would
        # be unroutable, and one with some of its shards would move keys as the rest are bound.
        *(Binding(names.hash, names.shard(shard), SHARD_WEIGHT) for shard in shards),
        *(
            Binding(names.ingress, names.hash, event_type, to_exchange=True)
            for event_type in sorted(spec.event_types)
        ),
        *(
            Binding(
                names.redeliver,
                names.shard(shard),
                arguments={"x-match": "all", SHARD: shard_label(shard)},
            )
            for shard in shards
        ),
    )
