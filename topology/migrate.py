"""Carry out a :class:`~topology.migration_plan.MigrationPlan` on the broker, step by step.

Every step looks before it acts (a queue that exists is not declared again, a source that is
gone has nothing to move, a queue already deleted is done), so a migration that stopped half-way
(killed, the broker lost, an operator's Ctrl-C) resumes when it is run again. Nothing about its
progress is kept anywhere but on the broker.

A message is moved by publishing a copy, waiting for the broker's confirm, and only then acking
the original: a move that dies in between leaves the original in place, to be moved (or consumed)
again, and the receipts make a second copy a duplicate. The copy is a new message to the broker:
its ``x-death`` and ``x-delivery-count`` start afresh (quorum queues count deliveries per queue).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aio_pika
import aiormq
from aio_pika.abc import (
    AbstractChannel,
    AbstractConnection,
    AbstractExchange,
    AbstractIncomingMessage,
)

from topology.apply import find_conflicts, missing
from topology.migration_plan import Bind, Declare, Delete, MigrationPlan, Move, Step, Unbind
from topology.model import Queue, Topology
from topology.names import RETRY_RUNG

__all__ = ["MigrationConflict", "MigrationReport", "MoveFailed", "StepResult", "run_migration"]

HeaderRewrite = Callable[[AbstractIncomingMessage], dict[str, Any]]
"""The headers a copy moved out of a work queue carries (the service decides which it trusts)."""

_BATCH = 500
_IDLE_SECONDS = 0.5
"""No delivery for this long: the source may be empty (its ready count says)."""
_POLL_SECONDS = 1.0


class MigrationConflict(RuntimeError):
    """A queue the new plan declares exists with other arguments."""


class MoveFailed(RuntimeError):
    """A copy was refused, returned or not confirmed in time: its original stays where it was."""


@dataclass(frozen=True, slots=True)
class StepResult:
    step: Step
    outcome: str
    """What the step did: ``created``, ``exists``, ``done``, ``moved 12``, ``deleted``, ``gone``."""
    pending: str | None = None
    """Set when the step cannot finish yet (a queue still consumed): why."""


@dataclass(frozen=True, slots=True)
class MigrationReport:
    results: tuple[StepResult, ...]

    @property
    def pending(self) -> str | None:
        return next((r.pending for r in self.results if r.pending is not None), None)


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


def _without_broker_headers(headers: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in headers.items() if not key.lower().startswith("x-")}


class _Runner:
    def __init__(
        self,
        connection: AbstractConnection,
        plan: MigrationPlan,
        rewrite_work_headers: HeaderRewrite,
        confirm_timeout: float,
        wait: float,
    ) -> None:
        self._connection = connection
        self._plan = plan
        self._rewrite = rewrite_work_headers
        self._confirm_timeout = confirm_timeout
        self._wait = wait

    async def _channel(self, *, confirms: bool = False) -> AbstractChannel:
        # An operation refused by the broker closes its channel: each step gets its own.
        return await self._connection.channel(
            publisher_confirms=confirms, on_return_raises=confirms
        )

    async def _queue_state(self, name: str) -> tuple[int, int] | None:
        """(ready messages, consumers) of ``name``, or None when it does not exist."""
        channel = await self._channel()
        try:
            declared = await channel.declare_queue(name, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return None
        finally:
            if not channel.is_closed:
                await channel.close()
        result = declared.declaration_result
        return int(result.message_count or 0), int(result.consumer_count or 0)

    async def run(self, step: Step) -> StepResult:
        if isinstance(step, Declare):
            return await self._declare(step.queue, step)
        if isinstance(step, Bind | Unbind):
            return await self._bind(step)
        if isinstance(step, Move):
            return StepResult(step, await self._move(step))
        return await self._delete(step)

    async def _declare(self, queue: Queue, step: Step) -> StepResult:
        alone = Topology(exchanges=(), queues=(queue,), bindings=())
        if not await missing(self._connection, alone):
            conflicts = await find_conflicts(self._connection, alone)
            if conflicts:
                raise MigrationConflict("; ".join(c.describe() for c in conflicts))
            return StepResult(step, "exists")
        channel = await self._channel()
        try:
            arguments = queue.declare_arguments
            await channel.declare_queue(queue.name, durable=queue.durable, arguments=arguments)
        finally:
            await channel.close()
        return StepResult(step, "created")

    async def _bind(self, step: Bind | Unbind) -> StepResult:
        binding = step.binding
        if not step.to_exchange and await self._queue_state(binding.queue) is None:
            # Unbinding from a queue already deleted: its bindings went with it.
            if isinstance(step, Unbind):
                return StepResult(step, "gone")
            raise MigrationConflict(f"queue {binding.queue} is missing: cannot bind it")
        channel = await self._channel()
        try:
            underlay = await channel.get_underlay_channel()
            arguments = dict(binding.arguments)
            key = binding.routing_key
            if isinstance(step, Bind) and step.to_exchange:
                await underlay.exchange_bind(
                    binding.queue, binding.exchange, key, arguments=arguments
                )
            elif isinstance(step, Bind):
                await underlay.queue_bind(binding.queue, binding.exchange, key, arguments=arguments)
            elif step.to_exchange:
                await underlay.exchange_unbind(
                    binding.queue, binding.exchange, key, arguments=arguments
                )
            else:
                await underlay.queue_unbind(binding.queue, binding.exchange, key, arguments)
        finally:
            if not channel.is_closed:
                await channel.close()
        return StepResult(step, "done")

    def _copy(self, message: AbstractIncomingMessage, step: Move) -> aio_pika.Message:
        headers = self._rewrite(message) if step.from_work else dict(message.headers or {})
        headers = _without_broker_headers(headers)
        if step.rung is not None:
            headers[RETRY_RUNG] = step.rung
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

    async def _move(self, step: Move) -> str:
        if await self._queue_state(step.source) is None:
            return "gone"
        # A consumer, not basic.get: a get on a quorum queue is a round of consensus each, some
        # 300 messages a second; a consumer with a prefetch moves thousands.
        take = await self._channel()
        put = await self._channel(confirms=True)
        inbox: asyncio.Queue[AbstractIncomingMessage] = asyncio.Queue()

        async def received(message: AbstractIncomingMessage) -> None:
            inbox.put_nowait(message)

        moved = 0
        try:
            await take.set_qos(prefetch_count=_BATCH)
            source = await take.get_queue(step.source, ensure=False)
            target = await put.get_exchange(step.exchange, ensure=False)
            tag = await source.consume(received, no_ack=False)
            while True:
                batch = await _next_batch(inbox, _IDLE_SECONDS)
                if batch:
                    moved += await self._copy_then_ack(batch, step, target)
                    continue
                state = await self._queue_state(step.source)
                if state is None or state[0] == 0:
                    break
            # What came before the cancel is ours to settle; nothing comes after it.
            await source.cancel(tag)
            rest = await _next_batch(inbox, 0)
            if rest:
                moved += await self._copy_then_ack(rest, step, target)
        finally:
            # Closing gives back every original not yet acked (after a failure), to be moved
            # again by the next run (those whose copy was confirmed, a second time).
            for channel in (take, put):
                if not channel.is_closed:
                    await channel.close()
        return f"moved {moved}"

    async def _copy_then_ack(
        self, batch: list[AbstractIncomingMessage], step: Move, target: AbstractExchange
    ) -> int:
        outcomes = await asyncio.gather(
            *(
                target.publish(
                    self._copy(message, step),
                    message.routing_key or "",
                    mandatory=True,
                    timeout=self._confirm_timeout,
                )
                for message in batch
            ),
            return_exceptions=True,
        )
        failed = [outcome for outcome in outcomes if isinstance(outcome, BaseException)]
        if failed:
            raise MoveFailed(
                f"{len(failed)} copies from {step.source} to {step.exchange} were not "
                f"confirmed ({type(failed[0]).__name__}: {failed[0]})"
            ) from failed[0]
        for message in batch:
            await message.ack()
        return len(batch)

    def _move_for(self, queue: str) -> Move | None:
        return next(
            (s for s in self._plan.steps if isinstance(s, Move) and s.source == queue), None
        )

    async def _delete(self, step: Delete) -> StepResult:
        deadline = time.monotonic() + self._wait
        move = self._move_for(step.queue)
        while True:
            if move is not None:
                # What consumers gave back since the move (a replica stopping returns what it
                # held) is moved too.
                await self._move(move)
            state = await self._queue_state(step.queue)
            if state is None:
                return StepResult(step, "gone")
            messages, consumers = state
            if messages == 0 and not (step.unused and consumers):
                break
            if time.monotonic() >= deadline:
                why = f"{step.queue} holds {messages} messages"
                if step.unused and consumers:
                    why = (
                        f"{step.queue} still has {consumers} consumers (replicas on the old "
                        "settings): roll them out, then run the migration again"
                    )
                return StepResult(step, "waiting", pending=why)
            await asyncio.sleep(_POLL_SECONDS)
        channel = await self._channel()
        try:
            # Quorum queues refuse if-empty/if-unused (not implemented): checked just above.
            await channel.queue_delete(step.queue)
        finally:
            if not channel.is_closed:
                await channel.close()
        return StepResult(step, "deleted")


async def run_migration(
    connection: AbstractConnection,
    plan: MigrationPlan,
    *,
    rewrite_work_headers: HeaderRewrite,
    confirm_timeout: float = 10.0,
    wait: float = 0.0,
    steps: int | None = None,
    on_step: Callable[[int, StepResult], None] = lambda number, result: None,
) -> MigrationReport:
    """Run ``plan``'s steps in order (only the first ``steps`` of them, if given).

    A step that cannot finish yet (an old work queue still consumed after ``wait`` seconds)
    stops the run: the report's :attr:`~MigrationReport.pending` says why, and running the same
    migration again goes on from there.
    """
    runner = _Runner(connection, plan, rewrite_work_headers, confirm_timeout, wait)
    results: list[StepResult] = []
    for number, step in enumerate(plan.steps[:steps], 1):
        result = await runner.run(step)
        results.append(result)
        on_step(number, result)
        if result.pending is not None:
            break
    return MigrationReport(tuple(results))
