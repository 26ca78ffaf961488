"""The topology of one service: what ``consumer topology apply`` declares, as data.

::

    producers -> [ingress] (topic) --rk = type--> (work) quorum, dead-letter -> [dlx]
    failed event: publish -> [retry] (headers: rung) -> (retry.<delay>) x-message-ttl
                                     expiry, dead-lettered -> [redeliver] (fanout) -> (work)
    poison, delivery limit, published dead letters -> [dlx] (fanout) -> (dead)
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from topology.broker_support import CONSUMER_TIMEOUT
from topology.durations import to_milliseconds
from topology.model import Binding, Exchange, ExchangeType, Queue, QueueType, Topology
from topology.names import RETRY_RUNG, Names, rung_label

__all__ = ["DEAD_QUEUE_DELIVERY_LIMIT", "TopologySpec", "build_topology"]

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


def build_topology(spec: TopologySpec) -> Topology:
    """The full plan for one service."""
    names = spec.names
    replicas: dict[str, Any] = {}
    if spec.quorum_group_size is not None:
        replicas["x-quorum-initial-group-size"] = spec.quorum_group_size
    exchanges = (
        Exchange(names.ingress, ExchangeType.TOPIC),
        Exchange(names.dlx, ExchangeType.FANOUT),
        Exchange(names.retry, ExchangeType.HEADERS),
        Exchange(names.redeliver, ExchangeType.FANOUT),
    )
    acknowledgement: dict[str, Any] = {}
    if spec.ack_timeout is not None:
        acknowledgement[CONSUMER_TIMEOUT] = to_milliseconds(spec.ack_timeout)
    work = Queue(
        names.work,
        QueueType.QUORUM,
        {
            "x-dead-letter-exchange": names.dlx,
            "x-delivery-limit": spec.delivery_limit,
            **_LOSSLESS_DEAD_LETTERING,
            **replicas,
            **acknowledgement,
        },
    )
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
        *(
            Binding(names.ingress, names.work, event_type)
            for event_type in sorted(spec.event_types)
        ),
        Binding(names.redeliver, names.work),
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
    return Topology(exchanges=exchanges, queues=(dead, work, *rungs), bindings=bindings)
