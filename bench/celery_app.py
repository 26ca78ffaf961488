"""The Celery 5 competitor: one task applying the receipt + reserve transaction with psycopg.

Worker: ``python -m celery -A bench.celery_app worker --pool prefork --concurrency 2`` (the
harness adds the flags). Configured from ``BENCH_*`` environment variables set by the harness:

- ``acks_late=True`` and ``task_reject_on_worker_lost=True``: acked after the task returns, and a
  task whose child died goes back to the queue, like the service's ack-after-commit.
- A quorum work queue (``task_default_queue_type="quorum"``). Celery 5.5+ detects it
  (``worker_detect_quorum_queues``, on by default), switches basic.qos to per-consumer (quorum
  queues have no global QoS) and declares its native delayed-delivery topology
  (``celery_delayed_*``), which the harness deletes afterwards if it did not exist before.
- Prefetch: ``worker_prefetch_multiplier`` x concurrency = the service's prefetch (rounded up).
- Remote control, events, gossip, mingle and heartbeats off: only the task consumer runs.

``python -m bench.celery_app publish EVENTS SKUS SEED`` publishes the workload as persistent
task messages through Celery's own producer.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any

from celery import Celery  # type: ignore[import-untyped, import-not-found, unused-ignore]

from bench.effect import Connections, apply_reserve
from bench.events import Workload

AMQP_URL = os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")
DATABASE_URL = os.environ.get("BENCH_DATABASE_URL", "postgresql://postgres@127.0.0.1:5432/bench")
QUEUE = os.environ.get("BENCH_QUEUE", "bench.celery")
CONCURRENCY = int(os.environ.get("BENCH_CONCURRENCY", "2"))
PREFETCH = int(os.environ.get("BENCH_PREFETCH", "50"))
CONSUMER = "celery"
TASK_NAME = "bench.reserve"

app = Celery("bench")
app.conf.update(
    broker_url=AMQP_URL,
    broker_connection_retry_on_startup=True,
    # The default queue, declared with x-queue-type: quorum (Celery 5.5+).
    task_default_queue=QUEUE,
    task_default_queue_type="quorum",
    task_create_missing_queue_type="quorum",
    task_default_exchange=QUEUE,
    task_default_exchange_type="topic",  # what native delayed delivery supports
    task_default_routing_key=QUEUE,
    task_default_delivery_mode="persistent",
    task_serializer="json",
    accept_content=["json"],
    task_acks_late=True,
    task_reject_on_worker_lost=True,
    task_ignore_result=True,
    worker_pool="prefork",
    worker_concurrency=CONCURRENCY,
    worker_prefetch_multiplier=max(1, math.ceil(PREFETCH / CONCURRENCY)),
    worker_detect_quorum_queues=True,
    worker_enable_remote_control=False,
    worker_send_task_events=False,
    worker_hijack_root_logger=False,
)

_connections = Connections(DATABASE_URL)


def reserve(event: dict[str, Any]) -> None:
    apply_reserve(_connections.get(), CONSUMER, event)


reserve_task = app.task(name=TASK_NAME, acks_late=True, reject_on_worker_lost=True)(reserve)


def publish(workload: Workload) -> int:
    sent = 0
    with app.producer_or_acquire() as producer:
        for event in workload.envelopes():
            reserve_task.apply_async((event,), producer=producer)
            sent += 1
    return sent


if __name__ == "__main__":
    if len(sys.argv) != 5 or sys.argv[1] != "publish":
        sys.exit("usage: python -m bench.celery_app publish EVENTS SKUS SEED")
    count = publish(Workload(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])))
    print(count)
