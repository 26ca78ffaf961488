"""The message headers the service reads and writes.

The service's own headers are named ``consumer-*``: RabbitMQ 4 ignores (and may strip) client-set
``x-*`` headers, and headers-exchange bindings never match on them. The attempt count is read from
:data:`ATTEMPT`, never from ``x-death``, whose shape differs between broker versions.

They are the service's only when it wrote them: a producer's ``consumer-*`` headers are dropped on
arrival (:func:`trusted_headers`), so that nobody else can set an event's attempt count, the routing
key a replay goes out with, or the reason an operator reads on a dead letter. Every copy the service
publishes drops every ``x-*`` header (:func:`without_broker_headers`), so a dead letter with
``x-death`` is one the broker dead-lettered, whose ``consumer-*`` headers the dead-letter tools do
not trust (:mod:`consumer.cli.dlq.letters`).
"""

from __future__ import annotations

from collections.abc import Mapping
from datetime import datetime
from typing import Any

from topology.names import ORIGINAL_ROUTING_KEY, RETRY_RUNG, SHARD, SHARD_KEY

__all__ = [
    "ATTEMPT",
    "DEAD_LETTERED_AT",
    "ERROR_CLASS",
    "ERROR_MESSAGE",
    "ERROR_MESSAGE_LIMIT",
    "FIRST_FAILURE_AT",
    "LAST_FAILURE_AT",
    "MAX_ATTEMPT",
    "ORIGINAL_EXCHANGE",
    "ORIGINAL_ROUTING_KEY",
    "OWN_PREFIX",
    "QUEUE",
    "REASON",
    "REPLAYS",
    "SERVICE",
    "Headers",
    "attempts_so_far",
    "dead_letter_headers",
    "replay_headers",
    "retry_headers",
    "text",
    "truncate",
    "trusted_headers",
    "without_broker_headers",
]

ATTEMPT = "consumer-attempt"
"""Retries published so far for this event (absent on the first delivery)."""
FIRST_FAILURE_AT = "consumer-first-failure-at"
LAST_FAILURE_AT = "consumer-last-failure-at"
ERROR_CLASS = "consumer-error-class"
ERROR_MESSAGE = "consumer-error-message"
REASON = "consumer-dead-reason"
"""Why the service dead-lettered the event: ``permanent_failure`` or ``retries_exhausted``."""
ORIGINAL_EXCHANGE = "consumer-original-exchange"
SERVICE = "consumer-service"
QUEUE = "consumer-queue"
"""On a dead letter of a queue table's queue: the queue's name in the table (``sms``); absent
for a service without a table, which has one queue."""
DEAD_LETTERED_AT = "consumer-dead-lettered-at"
REPLAYS = "consumer-replays"
"""How many times an operator replayed this event from the dead-letter queue."""
ORIGINAL_OCCURRED_AT = "consumer-original-occurred-at"
"""The occurred_at an expired event had before ``dlq replay --force`` made it a new one."""

_FAILURE_HEADERS = (
    ATTEMPT,
    RETRY_RUNG,
    FIRST_FAILURE_AT,
    LAST_FAILURE_AT,
    ERROR_CLASS,
    ERROR_MESSAGE,
    REASON,
    DEAD_LETTERED_AT,
)

ERROR_MESSAGE_LIMIT = 500
MAX_ATTEMPT = 10_000
OWN_PREFIX = "consumer-"
"""The service's own headers' prefix."""
# Informational (the operator's replay count), or the producer's by design: the shard key a
# sharded queue's hash exchange hashes, kept on retry copies and dead letters so that a replay
# goes to its key's shard.
_FROM_ANYONE = frozenset({REPLAYS, ORIGINAL_OCCURRED_AT, SHARD_KEY})

Headers = dict[str, Any]


def text(value: object) -> str | None:
    """A header value as text: AMQP gives strings as ``str`` or ``bytes``."""
    if value is None:
        return None
    if isinstance(value, bytes | bytearray):
        return bytes(value).decode("utf-8", errors="replace")
    return str(value)


def trusted_headers(
    headers: Mapping[str, Any] | None, *, trusted: bool, shard: str | None = None
) -> Headers:
    """``headers`` without the service's own names unless ``trusted`` (the message came back from
    the service's own retry ladder); with ``shard`` (a sharded queue's shard it was consumed from,
    ``s2``), :data:`~topology.names.SHARD` set to it, whatever a copy said: the retry copies and
    dead letters made of the delivery carry it, and the queue's redeliver exchange routes a
    retry copy back to that shard by it (without it, no binding matches and the copy is lost)."""
    if not headers:
        kept: Headers = {}
    elif trusted:
        kept = dict(headers)
    else:
        kept = {
            key: value
            for key, value in headers.items()
            if not key.startswith(OWN_PREFIX) or key in _FROM_ANYONE
        }
    if shard is not None:
        kept[SHARD] = shard
    return kept


def attempts_so_far(headers: Mapping[str, Any] | None) -> int:
    """Retries already published for this event (:data:`ATTEMPT`); 0 if absent or unreadable."""
    if not headers:
        return 0
    value = headers.get(ATTEMPT)
    if isinstance(value, bool):
        return 0
    if isinstance(value, int):
        return min(max(value, 0), MAX_ATTEMPT)
    raw = (text(value) or "").strip()
    if not (raw.isascii() and raw.isdigit()):
        return 0
    # Python refuses to turn more than 4,300 digits into an int; nothing near is an attempt count.
    return MAX_ATTEMPT if len(raw) > len(str(MAX_ATTEMPT)) else min(int(raw), MAX_ATTEMPT)


def without_broker_headers(headers: Mapping[str, Any] | None) -> Headers:
    """The headers minus every ``x-*`` one: ``x-death``, ``x-first-death-*``, ``x-delivery-count``.

    A republished copy must not carry ``x-death``: RabbitMQ drops a message dead-lettered into a
    queue it already passed through when the cycle holds no rejection, which is what a
    retried-then-replayed message looks like.
    """
    return {
        key: value for key, value in (headers or {}).items() if not key.lower().startswith("x-")
    }


def truncate(message: str, limit: int = ERROR_MESSAGE_LIMIT) -> str:
    """One line of at most ``limit`` characters."""
    flat = " ".join(message.split())
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"


def _failure(
    headers: Mapping[str, Any] | None, error_class: str, error_message: str, now: str
) -> Headers:
    copy = without_broker_headers(headers)
    copy.setdefault(FIRST_FAILURE_AT, now)
    copy[LAST_FAILURE_AT] = now
    copy[ERROR_CLASS] = error_class
    copy[ERROR_MESSAGE] = truncate(error_message)
    return copy


def retry_headers(
    headers: Mapping[str, Any] | None,
    *,
    attempt: int,
    rung: str,
    error_class: str,
    error_message: str,
    original_exchange: str,
    original_routing_key: str,
    now: datetime,
) -> Headers:
    """Headers for the copy published to a retry rung."""
    copy = _failure(headers, error_class, error_message, now.isoformat())
    copy[ATTEMPT] = attempt
    copy[RETRY_RUNG] = rung
    copy.setdefault(ORIGINAL_EXCHANGE, original_exchange)
    copy.setdefault(ORIGINAL_ROUTING_KEY, original_routing_key)
    return copy


def dead_letter_headers(
    headers: Mapping[str, Any] | None,
    *,
    reason: str,
    attempts: int,
    error_class: str,
    error_message: str,
    original_exchange: str,
    original_routing_key: str,
    service: str,
    now: datetime,
    queue: str | None = None,
) -> Headers:
    """Headers for the copy published to the dead-letter exchange: what an operator needs."""
    stamp = now.isoformat()
    copy = _failure(headers, error_class, error_message, stamp)
    copy.pop(RETRY_RUNG, None)
    copy[REASON] = reason
    copy[ATTEMPT] = attempts
    copy[DEAD_LETTERED_AT] = stamp
    copy[SERVICE] = service
    if queue is not None:
        copy[QUEUE] = queue
    copy.setdefault(ORIGINAL_EXCHANGE, original_exchange)
    copy.setdefault(ORIGINAL_ROUTING_KEY, original_routing_key)
    return copy


def replay_headers(headers: Mapping[str, Any] | None) -> Headers:
    """Headers for a dead letter sent back for another try: failure state gone, attempts reset."""
    copy = without_broker_headers(headers)
    replays = attempts_so_far({ATTEMPT: copy.get(REPLAYS)})
    for key in _FAILURE_HEADERS:
        copy.pop(key, None)
    copy[REPLAYS] = replays + 1
    return copy
