"""The paced publisher of the latency runs: one for every system, so that each pays the same.

Straight on aiormq with publisher confirms. Every tick (``TICK`` seconds) it publishes the
messages that are due by then and gathers their confirms in one future, rather than a task per
message: the harness shares the machine's cores with what it measures, so its work per message is
kept small, and the latency table reports its CPU (``harness``).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from datetime import UTC, datetime
from typing import Any

import aiormq

from bench.events import Workload, envelope
from bench.infra import BenchError
from bench.wire import Wire

TICK = 0.002


def due(elapsed: float, rate: float, total: int) -> int:
    """How many messages are due ``elapsed`` seconds after the start: the first at once, then
    ``rate`` a second, never more than ``total``."""
    if elapsed < 0:
        return 0
    return min(total, int(elapsed * rate) + 1)


async def paced_publish(
    amqp_url: str, wire: Wire, workload: Workload, rate: float, seconds: float
) -> dict[uuid.UUID, float]:
    """Publish ``rate`` events a second for ``seconds``, each built by ``wire`` with its
    ``occurred_at`` = its publish time; every one confirmed. Returns the publish times
    (``time.time()``) by event id."""
    published: dict[uuid.UUID, float] = {}
    templates = workload.envelopes()
    connection = await aiormq.connect(amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        confirming: list[asyncio.Future[Any]] = []
        total = int(rate * seconds)
        start = time.monotonic()
        sent = 0
        while sent < total:
            tick: list[Any] = []
            for _ in range(due(time.monotonic() - start, rate, total) - sent):
                template = next(templates)
                now = time.time()
                event_id = uuid.UUID(template["event_id"])
                event = envelope(
                    event_id,
                    template["payload"]["sku"],
                    template["payload"]["order_id"],
                    occurred_at=datetime.fromtimestamp(now, UTC).isoformat(),
                )
                message = wire(event, now)
                published[event_id] = now
                tick.append(
                    channel.basic_publish(
                        message.body,
                        exchange=message.exchange,
                        routing_key=message.routing_key,
                        properties=aiormq.spec.Basic.Properties(**message.properties),
                        mandatory=True,
                    )
                )
            sent += len(tick)
            if tick:
                confirming.append(asyncio.ensure_future(asyncio.gather(*tick)))
            await asyncio.sleep(TICK)
        for confirmations in await asyncio.gather(*confirming):
            for confirmation in confirmations:
                if not isinstance(confirmation, aiormq.spec.Basic.Ack):
                    raise BenchError(f"a latency event was not confirmed: {confirmation!r}")
    finally:
        await connection.close()
    return published
