"""The Dramatiq competitor: one actor applying the receipt + reserve transaction with psycopg.

Worker: ``python -m dramatiq bench.dramatiq_app --processes 2 --threads 4`` (the harness adds the
flags), on Dramatiq's RabbitMQ broker (pika), configured from ``BENCH_*`` environment variables:

- Dramatiq acks a message after its actor returns (or dead-letters it to ``<queue>.XQ`` once its
  retries are spent): ack-after-commit, like the service.
- A quorum work queue: the broker declares the queue and its delay queue ``<queue>.DQ`` with
  ``x-queue-type: quorum`` added to Dramatiq's own arguments (its consumers use per-consumer
  basic.qos, which quorum queues support). ``<queue>.XQ`` (dead letters, a TTL) stays classic.
- Prefetch per process (``dramatiq_queue_prefetch``) = the service's prefetch / processes,
  rounded up, so the whole worker has as many deliveries in flight as the service.
- The default middleware (age limit, time limit, shutdown notifications, callbacks, pipelines,
  retries); Dramatiq 2 no longer includes the Prometheus exporter by default.

``python -m bench.dramatiq_app publish EVENTS SKUS SEED`` declares the queues through the broker,
then publishes the workload's messages (Dramatiq's own encoding, persistent) with aio-pika and
publisher confirms, which is much faster than Dramatiq's synchronous one-by-one enqueue.
"""

from __future__ import annotations

import asyncio
import os
import sys
from typing import Any

import dramatiq  # type: ignore[import-not-found, unused-ignore]
from dramatiq.brokers.rabbitmq import (  # type: ignore[import-not-found, unused-ignore]
    RabbitmqBroker,
)

from bench.effect import Connections, apply_reserve
from bench.events import Workload

AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/bench")
QUEUE = os.environ.get("BENCH_QUEUE", "bench_dramatiq")
CONSUMER = "dramatiq"
ACTOR_NAME = "bench_reserve"


class QuorumRabbitmqBroker(RabbitmqBroker):  # type: ignore[misc, unused-ignore]
    """Dramatiq's RabbitMQ broker, declaring its work and delay queues as quorum queues."""

    def _build_queue_arguments(self, queue_name: str) -> dict[str, Any]:
        base = super()._build_queue_arguments(queue_name)  # type: ignore[no-untyped-call, unused-ignore]
        arguments: dict[str, Any] = dict(base)
        arguments["x-queue-type"] = "quorum"
        return arguments


broker = QuorumRabbitmqBroker(url=AMQP_URL)
dramatiq.set_broker(broker)

_connections = Connections(DATABASE_URL)


def reserve(event: dict[str, Any]) -> None:
    apply_reserve(_connections.get(), CONSUMER, event)


reserve_actor = dramatiq.actor(queue_name=QUEUE, actor_name=ACTOR_NAME, broker=broker)(reserve)


async def _publish(bodies: list[bytes]) -> None:
    import aio_pika
    from aio_pika.abc import DeliveryMode

    connection = await aio_pika.connect(AMQP_URL)
    try:
        channel = await connection.channel(publisher_confirms=True)
        exchange = channel.default_exchange
        window = 1000
        for start in range(0, len(bodies), window):
            await asyncio.gather(
                *(
                    exchange.publish(
                        aio_pika.Message(body, delivery_mode=DeliveryMode.PERSISTENT),
                        routing_key=QUEUE,
                        timeout=60,
                    )
                    for body in bodies[start : start + window]
                )
            )
    finally:
        await connection.close()


def publish(workload: Workload) -> int:
    broker.declare_queue(QUEUE, ensure=True)
    broker.close()
    bodies = [reserve_actor.message(event).encode() for event in workload.envelopes()]
    asyncio.run(_publish(bodies))
    return len(bodies)


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "publish":
        sys.exit("usage: python -m bench.dramatiq_app publish EVENTS SKUS SEED")
    print(publish(Workload(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]))))
