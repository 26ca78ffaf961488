"""Carry out a :class:`~topology.migration_plan.MigrationPlan` on the broker, step by step.

Every step looks before it acts (a queue that exists is not declared again, a source that is
gone has nothing to move, a queue already deleted is done), so a migration that stopped half-way
(killed, the broker lost, an operator's Ctrl-C) resumes when it is run again. Nothing about its
progress is kept anywhere but on the broker.

Messages are moved by :mod:`topology.mover`: a copy confirmed before its original is acked.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.abc import ExchangeType as AmqpExchangeType

from topology.apply import find_conflicts, missing, set_binding
from topology.model import Exchange, Queue, Topology
from topology.mover import HeaderRewrite, move_messages, queue_state
from topology.steps import Bind, Declare, DeclareExchange, Delete, MigrationPlan, Move, Step, Unbind

__all__ = ["MigrationConflict", "MigrationReport", "StepResult", "run_migration"]

_POLL_SECONDS = 1.0


class MigrationConflict(RuntimeError):
    """A queue the new plan declares exists with other arguments."""


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

    async def _channel(self) -> AbstractChannel:
        # An operation refused by the broker closes its channel: each step gets its own.
        return await self._connection.channel(publisher_confirms=False)

    async def _move(self, step: Move) -> str:
        moved = await move_messages(self._connection, step, self._rewrite, self._confirm_timeout)
        return "gone" if moved is None else f"moved {moved}"

    async def run(self, step: Step) -> StepResult:
        if isinstance(step, Declare):
            return await self._declare(step.queue, step)
        if isinstance(step, DeclareExchange):
            return await self._declare(step.exchange, step)
        if isinstance(step, Bind | Unbind):
            return await self._bind(step)
        if isinstance(step, Move):
            return StepResult(step, await self._move(step))
        return await self._delete(step)

    async def _declare(self, item: Queue | Exchange, step: Step) -> StepResult:
        if isinstance(item, Queue):
            alone = Topology(exchanges=(), queues=(item,), bindings=())
        else:
            alone = Topology(exchanges=(item,), queues=(), bindings=())
        if not await missing(self._connection, alone):
            conflicts = await find_conflicts(self._connection, alone)
            if conflicts:
                raise MigrationConflict("; ".join(c.describe() for c in conflicts))
            return StepResult(step, "exists")
        channel = await self._channel()
        try:
            if isinstance(item, Queue):
                arguments = item.declare_arguments
                await channel.declare_queue(item.name, durable=item.durable, arguments=arguments)
            else:
                await channel.declare_exchange(
                    item.name,
                    AmqpExchangeType(item.type.value),
                    durable=item.durable,
                    # A hash exchange's hash-header: RabbitMQ keeps an exchange's first arguments.
                    arguments=dict(item.arguments) or None,
                )
        finally:
            await channel.close()
        return StepResult(step, "created")

    async def _bind(self, step: Bind | Unbind) -> StepResult:
        binding = step.binding
        # A plan's own binding to an exchange (the ingress's to a hash exchange) says so itself.
        to_exchange = step.to_exchange or binding.to_exchange
        if not to_exchange and await queue_state(self._connection, binding.queue) is None:
            # Unbinding from a queue already deleted: its bindings went with it.
            if isinstance(step, Unbind):
                return StepResult(step, "gone")
            raise MigrationConflict(f"queue {binding.queue} is missing: cannot bind it")
        channel = await self._channel()
        try:
            underlay = await channel.get_underlay_channel()
            as_planned = replace(binding, to_exchange=to_exchange)
            await set_binding(underlay, as_planned, remove=isinstance(step, Unbind))
        finally:
            if not channel.is_closed:
                await channel.close()
        return StepResult(step, "done")

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
            state = await queue_state(self._connection, step.queue)
            if state is None:
                return StepResult(step, "gone")
            messages, consumers = state
            if messages == 0 and not (step.unused and consumers):
                break
            if time.monotonic() >= deadline:
                why = f"{step.queue} holds {messages} messages"
                if step.unused and consumers:
                    who = (
                        "replicas on the old settings): roll them out"
                        if move is not None and move.from_work
                        else "a tool reading it, such as consumer events show): let it finish"
                    )
                    why = (
                        f"{step.queue} still has {consumers} consumers ({who}, then run the "
                        "migration again"
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
    migration again goes on from there. A queue of ``plan.absent`` on the broker raises
    :class:`MigrationConflict` before any step.
    """
    for queue in plan.absent:
        if await queue_state(connection, queue) is not None:
            # Before any step: the tables do not describe the install, so the steps are wrong.
            raise MigrationConflict(
                f"{queue} exists: the install has more shards than the tables say (a migration "
                "to fewer shards not finished: run it again, or roll it back)"
            )
    runner = _Runner(connection, plan, rewrite_work_headers, confirm_timeout, wait)
    results: list[StepResult] = []
    for number, step in enumerate(plan.steps[:steps], 1):
        result = await runner.run(step)
        results.append(result)
        on_step(number, result)
        if result.pending is not None:
            break
    return MigrationReport(tuple(results))
