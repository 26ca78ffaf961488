"""The minimal consumer that does the service's job, as the prefetch table's yardstick.

``python -m bench.samejob AMQP_URL QUEUE PREFETCH COUNT DSN CONSUMER`` consumes ``COUNT``
``inventory.reserve`` envelopes from ``QUEUE`` with basic.qos ``PREFETCH``, on aio-pika and
uvloop like the service, and applies whatever has arrived whenever its one connection is free:
one transaction per batch at hand (the receipts in one statement, the SKUs' rows locked in order,
the stock changes and movements in one, the seal the receipts need, COMMIT), then one
``multiple`` ack. No validation, retries, dead letters, isolation or metrics: what is left is the
job itself. It prints the same two JSON lines as :mod:`bench.ackonly`.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time
import uuid
from datetime import datetime
from typing import Any

import aio_pika
import asyncpg
import uvloop
from aio_pika.abc import AbstractIncomingMessage

from bench.ackonly import status_kb

RECEIPTS = """
INSERT INTO receipts (consumer, event_id, type, occurred_at)
SELECT $1, id, 'inventory.reserve', at
FROM unnest($2::uuid[], $3::timestamptz[]) AS r (id, at)
ORDER BY id
ON CONFLICT DO NOTHING RETURNING event_id
"""
LOCK = "SELECT sku FROM stock WHERE sku = ANY($1::text[]) ORDER BY sku FOR UPDATE"
RESERVE = """
WITH taken AS (
    UPDATE stock SET available = stock.available - taken.qty
    FROM (SELECT sku, sum(qty) AS qty FROM unnest($2::text[], $4::int[]) AS t (sku, qty)
          GROUP BY sku) AS taken
    WHERE stock.sku = taken.sku
)
INSERT INTO stock_movements (event_id, order_id, sku, delta)
SELECT id, order_id, sku, -qty FROM unnest($1::uuid[], $2::text[], $3::text[], $4::int[])
    AS m (id, sku, order_id, qty)
"""
SEAL = "SELECT set_config('consumer.sealed', 'yes', true)"


async def consume(
    url: str, queue_name: str, prefetch: int, count: int, dsn: str, consumer: str
) -> dict[str, float]:
    connection = await aio_pika.connect(url)
    conn = await asyncpg.connect(dsn)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.get_queue(queue_name, ensure=False)
        at_hand: list[AbstractIncomingMessage] = []
        arrived = asyncio.Event()
        first = first_cpu = 0.0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal first, first_cpu
            if not first:
                first, first_cpu = time.time(), time.process_time()
                print(json.dumps({"first": first}), flush=True)
            at_hand.append(message)
            arrived.set()

        tag = await queue.consume(on_message, no_ack=False)
        done = 0
        while done < count:
            await arrived.wait()
            arrived.clear()
            batch = at_hand[:]
            del at_hand[:]
            if not batch:
                continue
            await _apply(conn, consumer, [json.loads(m.body) for m in batch])
            await batch[-1].ack(multiple=True)
            done += len(batch)
        last, last_cpu = time.time(), time.process_time()
        await queue.cancel(tag)
        await channel.declare_queue(queue_name, passive=True)
        return {
            "first": first,
            "last": last,
            "count": done,
            "cpu_s": last_cpu - first_cpu,
            "peak_rss_mb": (status_kb("VmHWM") or 0) / 1024,
        }
    finally:
        await conn.close()
        await connection.close()


async def _apply(conn: asyncpg.Connection[Any], consumer: str, events: list[Any]) -> None:
    ids = [uuid.UUID(event["event_id"]) for event in events]
    occurred = [_timestamp(event["occurred_at"]) for event in events]
    skus = [event["payload"]["sku"] for event in events]
    async with conn.transaction():
        fresh = {row[0] for row in await conn.fetch(RECEIPTS, consumer, ids, occurred)}
        keep = [i for i, event_id in enumerate(ids) if event_id in fresh]
        if not keep:
            return
        await conn.execute(LOCK, sorted({skus[i] for i in keep}))
        await conn.execute(
            RESERVE,
            [ids[i] for i in keep],
            [skus[i] for i in keep],
            [str(events[i]["payload"]["order_id"]) for i in keep],
            [int(events[i]["payload"]["qty"]) for i in keep],
        )
        await conn.execute(SEAL)


def _timestamp(text: str) -> datetime:
    return datetime.fromisoformat(text.replace("Z", "+00:00"))


def main() -> None:
    if len(sys.argv) != 7:
        sys.exit("usage: python -m bench.samejob AMQP_URL QUEUE PREFETCH COUNT DSN CONSUMER")
    url, queue, prefetch, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    result = uvloop.run(consume(url, queue, prefetch, count, sys.argv[5], sys.argv[6]))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
