"""What the service's publisher and the replay's sender share: one publish per message id in
flight, and aiormq's publish errors translated into ours
(:mod:`consumer.errors`)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable
from typing import Any

import aiormq
from pamqp.commands import Basic

from consumer.amqp.connect import describe_amqp_error
from consumer.errors import PublishFailed, Unroutable

__all__ = [
    "PUBLISH_ERRORS",
    "OnePerMessageId",
    "acked",
    "closed_without_reason",
    "connection_blocked",
    "cut_off",
    "translated",
]

_READY_CHECK = 0.05

PUBLISH_ERRORS = (aiormq.exceptions.AMQPError, RuntimeError, ConnectionError)
"""What a publish raises when it fails: :func:`translated` says which of ours it is."""


class OnePerMessageId:
    """Publishes of one message id one at a time. aiormq matches a return to its publish by
    message id alone, and copies share one (the dead letters of one event, a producer's own id
    copied into each copy): with two in flight, a return fails the other publish while the
    returned one's ack confirms it, and the original whose copy the broker dropped is removed."""

    def __init__(self) -> None:
        self._in_flight: dict[str, asyncio.Future[Any]] = {}

    async def turn(self, properties: Basic.Properties) -> str:
        """Until no publish of this message id is in flight (one is given, if none); the id."""
        if not properties.message_id:
            properties.message_id = uuid.uuid4().hex
        message_id: str = properties.message_id
        while (earlier := self._in_flight.get(message_id)) is not None and not earlier.done():
            await asyncio.wait([earlier])
        return message_id

    def taken(self, message_id: str, settled: asyncio.Future[Any]) -> None:
        """The publish of ``message_id`` is in flight until ``settled`` is done."""
        self._in_flight[message_id] = settled

        def leave(_: asyncio.Future[Any]) -> None:
            if self._in_flight.get(message_id) is settled:
                del self._in_flight[message_id]

        settled.add_done_callback(leave)


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


async def acked(
    confirm: Awaitable[Any], *, waited_s: float, exchange: str, routing_key: str
) -> None:
    """Wait for a publish's confirm: return on the broker's ack, else raise :class:`Unroutable`
    or :class:`PublishFailed` (a nack, no confirm after ``waited_s``, the channel gone)."""
    try:
        result = await confirm
    except TimeoutError as error:
        raise PublishFailed(f"no confirm from the broker within {waited_s:g}s") from error
    except PUBLISH_ERRORS as error:
        raise translated(error, exchange=exchange, routing_key=routing_key) from error
    except asyncio.CancelledError as error:
        raise cut_off(error) from error
    except Exception as error:
        raise closed_without_reason(error) from error
    if not isinstance(result, Basic.Ack):
        raise PublishFailed(f"the broker did not confirm the message for {exchange!r}")


async def connection_blocked(connection: Any) -> bool:
    """Whether the broker has blocked this aiormq connection (``connection.blocked``): a confirm
    late for that is waited for, not given up."""
    try:
        await asyncio.wait_for(connection.ready(), _READY_CHECK)
    except TimeoutError:
        return True
    return False
