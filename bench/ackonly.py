"""The broker limit: the least a consumer can do, an aio-pika consumer that only acks.

``python -m bench.ackonly AMQP_URL QUEUE PREFETCH COUNT`` consumes ``COUNT`` messages from
``QUEUE`` with basic.qos ``PREFETCH`` (per consumer, as the service sets it) on uvloop, like the
service, acks each on arrival and prints two JSON lines: ``{"first": t}`` when the first delivery
arrives and ``{"first": t, "last": t, "count": n, "cpu_s": s, "peak_rss_mb": m}`` after the last
ack (``time.time()`` seconds; its own CPU time between the two, and its peak RSS). The last ack is
followed by a round trip on the channel (a passive declare), so by then the broker has taken every
ack.
"""

from __future__ import annotations

import asyncio
import json
import sys
import time

import aio_pika
import uvloop
from aio_pika.abc import AbstractIncomingMessage


async def consume(url: str, queue_name: str, prefetch: int, count: int) -> dict[str, float]:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        await channel.set_qos(prefetch_count=prefetch)
        queue = await channel.get_queue(queue_name, ensure=False)
        done = asyncio.Event()
        seen = 0
        first = last = first_cpu = last_cpu = 0.0

        async def on_message(message: AbstractIncomingMessage) -> None:
            nonlocal seen, first, last, first_cpu, last_cpu
            await message.ack()
            seen += 1
            if seen == 1:
                first, first_cpu = time.time(), time.process_time()
                print(json.dumps({"first": first}), flush=True)
            if seen >= count:
                last, last_cpu = time.time(), time.process_time()
                done.set()

        tag = await queue.consume(on_message, no_ack=False)
        await done.wait()
        await queue.cancel(tag)
        await channel.declare_queue(queue_name, passive=True)
        return {
            "first": first,
            "last": last,
            "count": seen,
            "cpu_s": last_cpu - first_cpu,
            "peak_rss_mb": (status_kb("VmHWM") or 0) / 1024,
        }
    finally:
        await connection.close()


def status_kb(key: str) -> int | None:
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(key + ":"):
                return int(line.split()[1])
    return None


def main() -> None:
    if len(sys.argv) != 5:
        sys.exit("usage: python -m bench.ackonly AMQP_URL QUEUE PREFETCH COUNT")
    url, queue, prefetch, count = sys.argv[1], sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
    result = uvloop.run(consume(url, queue, prefetch, count))
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()
