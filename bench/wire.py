"""Each system's native message for one event, built by hand for the paced publisher.

The latency runs publish every system's messages with one light publisher (``bench/paced.py``),
so none of them pays for a heavier client: these functions build what each system's own
client would send, at the cost of a ``json.dumps`` and a small dict per message.

- The service: its JSON envelope (the README's contract) to its ingress exchange, routed by type.
- Celery: task protocol 2 (what ``app.amqp.as_task_v2`` builds and ``apply_async`` sends): body
  ``[args, kwargs, embed]``, the task's name and id in the headers, to the task's exchange and
  routing key (both the queue's name in ``bench/celery_app.py``).
- Dramatiq: ``dramatiq.Message.encode()``'s JSON to the default exchange, routed to the queue.

``tests/unit/test_bench_wire.py`` holds them against what Celery and Dramatiq build themselves.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from bench.events import EVENT_TYPE, encode

CELERY_TASK = "bench.reserve"  # bench/celery_app.py's TASK_NAME (not imported: that loads Celery)
DRAMATIQ_ACTOR = "bench_reserve"  # bench/dramatiq_app.py's ACTOR_NAME
PERSISTENT = 2


@dataclass(frozen=True, slots=True)
class Outgoing:
    """One message as the publisher sends it: where to, its body and its AMQP properties."""

    exchange: str
    routing_key: str
    body: bytes
    properties: dict[str, Any]


Wire = Callable[[dict[str, Any], float], Outgoing]
"""The event's envelope and its publish time (``time.time()``) -> the message to publish."""


def service(exchange: str) -> Wire:
    def build(event: dict[str, Any], _: float) -> Outgoing:
        return Outgoing(
            exchange,
            EVENT_TYPE,
            encode(event),
            {
                "content_type": "application/json",
                "delivery_mode": PERSISTENT,
                "message_id": event["event_id"],
            },
        )

    return build


def celery(queue: str) -> Wire:
    def build(event: dict[str, Any], _: float) -> Outgoing:
        task_id = event["event_id"]
        args = [event]
        body = [args, {}, {"callbacks": None, "errbacks": None, "chain": None, "chord": None}]
        headers = {
            "lang": "py",
            "task": CELERY_TASK,
            "id": task_id,
            "shadow": None,
            "eta": None,
            "expires": None,
            "group": None,
            "group_index": None,
            "retries": 0,
            "timelimit": [None, None],
            "root_id": task_id,
            "parent_id": None,
            "argsrepr": "(...)",  # only shown in Celery's logs
            "kwargsrepr": "{}",
            "origin": "bench",
            "ignore_result": True,
            "replaced_task_nesting": 0,
            "stamped_headers": None,
            "stamps": {},
        }
        return Outgoing(
            queue,
            queue,
            json.dumps(body, separators=(",", ":")).encode(),
            {
                "content_type": "application/json",
                "content_encoding": "utf-8",
                "delivery_mode": PERSISTENT,
                "priority": 0,
                "correlation_id": task_id,
                "reply_to": "",
                "headers": headers,
            },
        )

    return build


def dramatiq(queue: str) -> Wire:
    def build(event: dict[str, Any], published: float) -> Outgoing:
        message = {
            "queue_name": queue,
            "actor_name": DRAMATIQ_ACTOR,
            "args": [event],
            "kwargs": {},
            "options": {},
            "message_id": str(uuid.UUID(event["event_id"])),
            "message_timestamp": int(published * 1000),
        }
        return Outgoing(
            "",
            queue,
            json.dumps(message, separators=(",", ":")).encode(),
            {"delivery_mode": PERSISTENT},
        )

    return build
