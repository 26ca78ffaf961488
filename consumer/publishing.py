"""What the service's publisher and the replay's sender share: the span a publish runs in, and
aiormq's publish errors translated into ours (:mod:`consumer.errors`)."""

from __future__ import annotations

import asyncio
import contextlib
from contextlib import AbstractContextManager
from typing import Any

import aiormq
from pamqp.commands import Basic

from consumer.amqp import describe_amqp_error
from consumer.errors import PublishFailed, Unroutable
from consumer.tracing import Tracing

__all__ = [
    "PUBLISH_ERRORS",
    "closed_without_reason",
    "connection_blocked",
    "cut_off",
    "publish_span",
    "translated",
]

_READY_CHECK = 0.05

PUBLISH_ERRORS = (aiormq.exceptions.AMQPError, RuntimeError, ConnectionError)
"""What a publish raises when it fails: :func:`translated` says which of ours it is."""


def publish_span(
    tracing: Tracing, properties: Basic.Properties, *, exchange: str, routing_key: str
) -> AbstractContextManager[None]:
    """The span around one publish, its context carried in the headers; nothing when tracing is
    off (no headers table is added then)."""
    if not tracing.enabled:
        return contextlib.nullcontext()
    if properties.headers is None:
        properties.headers = {}
    return tracing.sending(
        properties.headers,
        exchange=exchange,
        routing_key=routing_key,
        message_id=properties.message_id,
    )


def translated(error: BaseException, *, exchange: str, routing_key: str) -> PublishFailed:
    """A failed publish's error as ours: returned (unroutable), nacked, or the channel gone."""
    if isinstance(error, aiormq.exceptions.PublishError):
        return Unroutable(f"{exchange!r} could not route {routing_key!r}")
    if isinstance(error, aiormq.exceptions.DeliveryError):
        return PublishFailed(f"the broker refused the message for {exchange!r}")
    return PublishFailed(f"publishing failed: {describe_amqp_error(error)}")


def cut_off(error: asyncio.CancelledError) -> PublishFailed:
    """A confirm that a closing connection cut off, as a failed publish; re-raises ``error`` when
    it is the waiting task's own cancel. aiormq fails a closing connection's futures with the
    CancelledError that stopped its reader (a broker silent past the heartbeat): that one is not
    ours, and taken for a cancel it would stop the caller with its letter or event unsettled."""
    task = asyncio.current_task()
    if task is None or task.cancelling():
        raise error
    return PublishFailed("publishing failed: the connection closed")


def closed_without_reason(error: Exception) -> PublishFailed:
    """A confirm failed with a bare ``Exception``, as a failed publish; re-raises ``error`` when it
    is anything else. aiormq rejects every future of a connection whose reader ended without an
    error (the socket closed between two frames, or its close racing ours) with ``Exception``
    itself: let through, it would leave the caller's letter or event neither settled nor counted."""
    if type(error) is not Exception:
        raise error
    return PublishFailed("publishing failed: the connection closed")


async def connection_blocked(connection: Any) -> bool:
    """Whether the broker has blocked this aiormq connection (``connection.blocked``): a confirm
    late for that is waited for, not given up."""
    try:
        await asyncio.wait_for(connection.ready(), _READY_CHECK)
    except TimeoutError:
        return True
    return False
