"""What a plan asks of the broker's version: a queue's own delivery acknowledgement timeout.

RabbitMQ closes the channel of a delivery held unacknowledged longer than its ``consumer_timeout``
(``rabbitmq.conf``, 30 minutes by default, for every queue of the broker). Since RabbitMQ 3.12 a
queue may have its own: the optional queue argument ``x-consumer-timeout`` (milliseconds), set when
the queue is declared, or the ``consumer-timeout`` key of a policy (RabbitMQ's consumers guide,
"Per-queue Configuration"; the timeout is checked once a minute). The plan uses the argument: it
travels with the declaration, as the work queue's other arguments do, and needs neither the
management API nor the right to set policies (a policy would also displace any other policy the
operator applies to the queue: one policy applies at a time).

An older broker takes the argument and ignores it: the queue would be declared, the long work
started, and its channel closed at the broker's timeout, over and over. So a plan that sets it is
refused on a broker older than 3.12 (:func:`unsupported`), with what to do instead: raise
``consumer_timeout`` in ``rabbitmq.conf`` (every queue of the broker gets it) and declare it
(``CONSUMER_BROKER_ACK_TIMEOUT``).

RabbitMQ compares only some arguments when a queue is declared again, and up to 4.2 not this one:
set on a work queue that exists without it, it is accepted and not applied. Give such a queue a new
``work_queue_version`` (a new queue, declared with it).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

from topology.model import Topology

__all__ = [
    "CONSUMER_TIMEOUT",
    "PER_QUEUE_CONSUMER_TIMEOUT_SINCE",
    "asks_version",
    "broker_version",
    "unsupported",
]

CONSUMER_TIMEOUT = "x-consumer-timeout"
"""The queue argument of a queue's own delivery acknowledgement timeout, in milliseconds."""

PER_QUEUE_CONSUMER_TIMEOUT_SINCE = (3, 12)
"""The first RabbitMQ version that honours :data:`CONSUMER_TIMEOUT`."""

_VERSION = re.compile(r"^(\d+)\.(\d+)")


def broker_version(server_properties: Mapping[str, object]) -> str | None:
    """The version the broker announced when the connection opened (``None`` if it did not)."""
    version = server_properties.get("version")
    if isinstance(version, bytes):
        version = version.decode("utf-8", "replace")
    return version if isinstance(version, str) and version else None


def _parsed(version: str) -> tuple[int, int] | None:
    match = _VERSION.match(version)
    return (int(match[1]), int(match[2])) if match else None


def _timed(topology: Topology) -> list[str]:
    return [queue.name for queue in topology.queues if CONSUMER_TIMEOUT in queue.arguments]


def asks_version(topology: Topology) -> bool:
    """Whether ``topology`` sets anything only some broker versions honour."""
    return bool(_timed(topology))


def unsupported(topology: Topology, version: str | None) -> str | None:
    """The one line refusing ``topology`` on a broker of ``version`` (``None``: unknown), or
    ``None`` when the broker supports all it asks."""
    queues = _timed(topology)
    if not queues:
        return None
    parsed = _parsed(version) if version is not None else None
    if parsed is not None and parsed >= PER_QUEUE_CONSUMER_TIMEOUT_SINCE:
        return None
    since = ".".join(map(str, PER_QUEUE_CONSUMER_TIMEOUT_SINCE))
    return (
        f"ack_timeout: RabbitMQ {version or '(version not announced)'} does not support a "
        f"queue's own delivery acknowledgement timeout ({CONSUMER_TIMEOUT}, RabbitMQ {since} and "
        f"later), which ack_timeout sets on {', '.join(queues)}: remove ack_timeout, raise "
        "consumer_timeout in rabbitmq.conf (milliseconds, for every queue of the broker) and "
        "declare it in CONSUMER_BROKER_ACK_TIMEOUT; or upgrade RabbitMQ"
    )
