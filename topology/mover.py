"""Moving every message of one queue to an exchange (or, by event type, to several), losing none:
the migration's one way of draining a queue.

Each copy is published in confirm mode (mandatory: an unroutable copy is returned, and fails),
and its original acked only once the broker confirmed it. A mover that dies in between leaves the
original in place, to be moved (or consumed) again; the receipts make a second copy a duplicate.
The copy is a new message to the broker: its ``x-death`` and ``x-delivery-count`` start afresh.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable, Mapping
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection, AbstractExchange, AbstractIncomingMessage

from topology.names import RETRY_RUNG, SHARD
from topology.steps import Move

__all__ = ["HeaderRewrite", "MoveFailed", "move_messages", "queue_state"]

HeaderRewrite = Callable[[AbstractIncomingMessage], dict[str, Any]]
"""The headers a copy moved out of a work queue carries (the service decides which it trusts)."""

_BATCH = 500
_IDLE_SECONDS = 0.5
"""No delivery for this long: the source may be empty (its ready count says)."""


class MoveFailed(RuntimeError):
    """A copy was refused, returned or not confirmed in time: its original stays where it was."""


async def queue_state(connection: AbstractConnection, name: str) -> tuple[int, int] | None:
    """(ready messages, consumers) of ``name``, or None when it does not exist."""
    # A passive declare of a missing queue closes its channel: it gets one of its own.
    channel = await connection.channel(publisher_confirms=False)
    try:
        declared = await channel.declare_queue(name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return None
    finally:
        if not channel.is_closed:
            await channel.close()
    result = declared.declaration_result
    return int(result.message_count or 0), int(result.consumer_count or 0)


async def _next_batch(
    inbox: asyncio.Queue[AbstractIncomingMessage], wait: float
) -> list[AbstractIncomingMessage]:
    """What has been delivered, waiting up to ``wait`` seconds for the first (none: empty)."""
    batch: list[AbstractIncomingMessage] = []
    if inbox.empty() and wait > 0:
        try:
            batch.append(await asyncio.wait_for(inbox.get(), wait))
        except TimeoutError:
            return batch
    while not inbox.empty() and len(batch) < _BATCH:
        batch.append(inbox.get_nowait())
    return batch


def _copy(
    message: AbstractIncomingMessage, step: Move, rung: str | None, rewrite: HeaderRewrite
) -> aio_pika.Message:
    headers = rewrite(message) if step.from_work else dict(message.headers or {})
    headers = {key: value for key, value in headers.items() if not key.lower().startswith("x-")}
    if rung is not None:
        headers[RETRY_RUNG] = rung
    if step.shard is not None:
        # A leaving shard's own label: the redeliver exchange hashes the copy again by its key.
        headers[SHARD] = step.shard
    return aio_pika.Message(
        message.body,
        headers=headers,
        content_type=message.content_type,
        content_encoding=message.content_encoding,
        delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
        priority=message.priority,
        correlation_id=message.correlation_id,
        reply_to=message.reply_to,
        # A producer's own per-message TTL stays; it restarts with the copy.
        expiration=message.expiration,
        message_id=message.message_id,
        timestamp=message.timestamp,
        type=message.type,
        app_id=message.app_id,
        # user_id is dropped: the broker refuses one that is not the publisher's.
    )


async def _publish_copy(
    message: AbstractIncomingMessage,
    step: Move,
    targets: Mapping[str, AbstractExchange],
    rewrite: HeaderRewrite,
    confirm_timeout: float,
) -> object:
    routing_key = message.routing_key or ""
    exchange, rung = step.destination(routing_key)
    return await targets[exchange].publish(
        _copy(message, step, rung, rewrite),
        routing_key,
        mandatory=True,
        timeout=confirm_timeout,
    )


async def _copy_then_ack(
    batch: list[AbstractIncomingMessage],
    step: Move,
    targets: Mapping[str, AbstractExchange],
    rewrite: HeaderRewrite,
    confirm_timeout: float,
) -> int:
    outcomes = await asyncio.gather(
        *(_publish_copy(message, step, targets, rewrite, confirm_timeout) for message in batch),
        return_exceptions=True,
    )
    failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
    if failed:
        raise MoveFailed(
            f"{len(failed)} copies from {step.source} to {', '.join(step.exchanges)} were not "
            f"confirmed ({type(failed[0]).__name__}: {failed[0]})"
        ) from failed[0]
    for message in batch:
        await message.ack()
    return len(batch)


async def move_messages(
    connection: AbstractConnection, step: Move, rewrite: HeaderRewrite, confirm_timeout: float
) -> int | None:
    """Move what ``step.source`` holds until it has nothing ready; how many (None: no source).

    Other consumers of the source (old replicas) may go on meanwhile: each message is either
    consumed by them or moved, once it is acked."""
    if await queue_state(connection, step.source) is None:
        return None
    # A consumer, not basic.get: a get on a quorum queue is a round of consensus each, some
    # 300 messages a second; a consumer with a prefetch moves thousands.
    take = await connection.channel(publisher_confirms=False)
    put = await connection.channel(publisher_confirms=True, on_return_raises=True)
    inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()

    async def received(message: AbstractIncomingMessage) -> None:
        inbox.put_nowait(message)

    moved = 0
    try:
        await take.set_qos(prefetch_count=_BATCH)
        source = await take.get_queue(step.source, ensure=False)
        targets = {name: await put.get_exchange(name, ensure=False) for name in step.exchanges}
        tag = await source.consume(received, no_ack=False)
        while True:
            batch = await _next_batch(inbox, _IDLE_SECONDS)
            if batch:
                moved += await _copy_then_ack(batch, step, targets, rewrite, confirm_timeout)
                continue
            state = await queue_state(connection, step.source)
            if state is None or state[0] == 0:
                break
        # What came before the cancel is ours to settle; nothing comes after it.
        await source.cancel(tag)
        rest = await _next_batch(inbox, 0)
        if rest:
            moved += await _copy_then_ack(rest, step, targets, rewrite, confirm_timeout)
    finally:
        # Closing gives back every original not yet acked (after a failure), to be moved again
        # by the next run (those whose copy was confirmed, a second time).
        for channel in (take, put):
            if not channel.is_closed:
                await channel.close()
    return moved
