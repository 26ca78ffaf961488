"""Build the topology from the settings and the handlers' event types.

::

    producers -> [ingress] (topic) --rk = type--> (work) quorum, dead-letter -> [dlx]
    failed event: publish -> [retry] (headers: rung) -> (retry.<delay>) x-message-ttl
                                     expiry, dead-lettered -> [redeliver] (fanout) -> (work)
    poison, delivery limit, published dead letters -> [dlx] (fanout) -> (dead)
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from consumer.durations import to_milliseconds
from consumer.headers import RETRY_RUNG
from consumer.retry import rung_label
from consumer.settings import Settings
from topology.model import Binding, Exchange, ExchangeType, Queue, QueueType, Topology
from topology.names import Names

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


def names_for(settings: Settings) -> Names:
    return Names(service=settings.name, ingress=settings.exchange)


def build_topology(settings: Settings, event_types: Iterable[str]) -> Topology:
    """The full plan for one service: what ``consumer topology apply`` declares."""
    names = names_for(settings)
    exchanges = (
        Exchange(names.ingress, ExchangeType.TOPIC),
        Exchange(names.dlx, ExchangeType.FANOUT),
        Exchange(names.retry, ExchangeType.HEADERS),
        Exchange(names.redeliver, ExchangeType.FANOUT),
    )
    work = Queue(
        names.work,
        QueueType.QUORUM,
        {
            "x-dead-letter-exchange": names.dlx,
            "x-delivery-limit": settings.delivery_limit,
            **_LOSSLESS_DEAD_LETTERING,
        },
    )
    dead = Queue(names.dead, QueueType.QUORUM, {"x-delivery-limit": DEAD_QUEUE_DELIVERY_LIMIT})
    rungs = tuple(
        Queue(
            names.rung(delay),
            QueueType.QUORUM,
            {
                "x-message-ttl": to_milliseconds(delay),
                "x-dead-letter-exchange": names.redeliver,
                **_LOSSLESS_DEAD_LETTERING,
            },
        )
        for delay in settings.retry_delays
    )
    bindings = (
        *(Binding(names.ingress, names.work, event_type) for event_type in sorted(event_types)),
        Binding(names.redeliver, names.work),
        Binding(names.dlx, names.dead),
        *(
            Binding(
                names.retry,
                names.rung(delay),
                arguments={"x-match": "all", RETRY_RUNG: rung_label(delay)},
            )
            for delay in settings.retry_delays
        ),
    )
    return Topology(exchanges=exchanges, queues=(dead, work, *rungs), bindings=bindings)
