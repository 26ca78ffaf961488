"""Calling handlers: under their time limit, timed, checked, and known to the watchdog.

The watchdog runs in its own thread and looks only while the event loop is blocked: the task the
loop is stuck in is then the current task, and the call registered for it (:class:`HandlerCalls`)
names the event whose handler blocked the loop. A call is registered per task, not in one slot (nor
a ``ContextVar``, which another thread cannot read), because several workers' calls are open at
once and only one of them can be the one running.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol, TypeVar
from uuid import UUID

import asyncpg

from consumer.deadlines import Deadline
from consumer.errors import (
    HandlerEndedTransaction,
    HandlerRaisedBaseException,
    HandlerTimeout,
    PipelineFault,
)
from consumer.outbox import Publishes
from consumer.pipeline.follow_ups import FollowUpWriter
from consumer.pipeline.handler_time import HandlerTime, Stepped
from consumer.pipeline.ready import Ready
from topology.durations import format_duration

__all__ = ["HandlerCall", "HandlerCaller", "HandlerCalls", "RunningCall", "connection_lost"]

T = TypeVar("T")


class RunningCall(Protocol):
    """What the watchdog reads of the call the event loop is stuck in."""

    @property
    def handler(self) -> str: ...

    @property
    def event_ids(self) -> tuple[UUID, ...]: ...

    def describe(self) -> dict[str, Any]: ...


@dataclass(frozen=True, slots=True)
class HandlerCall:
    """One call of a handler: one event, or a batch handler's run of several."""

    handler: str
    event_type: str
    event_ids: tuple[UUID, ...]
    message_id: str | None

    def describe(self) -> dict[str, Any]:
        """The fields a log line names the call by."""
        fields: dict[str, Any] = {
            "event_id": str(self.event_ids[0]) if self.event_ids else None,
            "type": self.event_type,
            "message_id": self.message_id,
            "handler": self.handler,
        }
        if len(self.event_ids) > 1:
            fields["batch_events"] = len(self.event_ids)
        return fields


class HandlerCalls:
    """The open handler calls, by the task that makes them."""

    def __init__(self) -> None:
        self._by_task: dict[asyncio.Task[Any], RunningCall] = {}

    @contextmanager
    def entered(self, call: RunningCall) -> Iterator[None]:
        task = self.enter(call)
        try:
            yield
        finally:
            self.leave(task)

    def enter(self, call: RunningCall) -> asyncio.Task[Any] | None:
        """Register ``call`` for the current task until :meth:`leave` with what this returns:
        the context manager :meth:`entered` without its cost, for a call made per delivery."""
        try:
            task = asyncio.current_task()
        except RuntimeError:  # no event loop (a tool parsing outside the service)
            return None
        if task is not None:
            self._by_task[task] = call
        return task

    def leave(self, task: asyncio.Task[Any] | None) -> None:
        if task is not None:
            self._by_task.pop(task, None)

    def running(self, loop: asyncio.AbstractEventLoop) -> RunningCall | None:
        """The call ``loop`` is in right now; safe from another thread while the loop is stuck."""
        task = asyncio.current_task(loop)
        return self._by_task.get(task) if task is not None else None


class HandlerCaller:
    """Runs one handler call (one event, or a batch handler's run) on the event's connection."""

    def __init__(
        self,
        *,
        default_timeout: float,
        calls: HandlerCalls,
        handler_time: HandlerTime | None = None,
        follow_ups: FollowUpWriter | None = None,
    ) -> None:
        """``handler_time``: where each call's wall and CPU time are added up; ``follow_ups``:
        what writes the events a call publishes (without it, ``event.publish`` raises)."""
        self._default_timeout = default_timeout
        self._calls = calls
        self._time = handler_time or HandlerTime()
        self._follow_ups = follow_ups

    async def run(self, conn: asyncpg.Connection[Any], item: Ready) -> None:
        """The handler of one event; a timeout becomes :class:`HandlerTimeout`. An exception it
        returns instead of raising (as a batch handler's result says) fails the event alike."""

        async def call() -> None:
            # Typed to return None, which is what this checks.
            result: object = await item.handler.func(item.event, conn)  # type: ignore[func-returns-value]
            if isinstance(result, BaseException):
                raise result

        # A batch handler's single event (a run of one, a batch of one) goes through its
        # per-event form, but it is still a batch handler's call: counted as one, or a small
        # prefetch's runs of one would make the policy take it for a per-event handler that
        # awaits the database, and spread its window over several workers' tiny transactions
        # (consumer.service.concurrency_policy).
        await self._called(conn, [item], call, batch=item.handler.many is not None)

    async def run_batch(
        self, conn: asyncpg.Connection[Any], items: list[Ready]
    ) -> list[Exception | None]:
        """A batch handler's call for ``items``, under its time limit for the call as a whole."""
        handler = items[0].handler
        events = [item.event for item in items]
        return await self._called(
            conn,
            items,
            lambda: handler.apply_many(events, conn),
            batch=True,
            applied=_applied,
        )

    async def _called(
        self,
        conn: asyncpg.Connection[Any],
        items: list[Ready],
        call: Callable[[], Coroutine[Any, Any, T]],
        *,
        batch: bool,
        applied: Callable[[T], Sequence[bool]] | None = None,
    ) -> T:
        """``call()`` under the handler's soft time limit, each event charged an equal share of
        its time, registered for the watchdog; it must leave the transaction open. What it
        published for the events it applied (``applied`` of its result: which; default all) is
        written in that transaction, within the same time limit.

        A coroutine wrapping the call rather than a generator's context manager around it: every
        batch makes one, and the context manager cost several times more."""
        handler = items[0].handler
        limit = handler.timeout.total_seconds() if handler.timeout else self._default_timeout
        running = HandlerCall(
            handler=handler.qualname,
            event_type=handler.event_type,
            event_ids=tuple(item.event.event_id for item in items),
            message_id=items[0].delivery.message_id,
        )
        calls = self._calls
        started = time.perf_counter()
        deadline = Deadline(limit)
        # Stepped: the handler's own CPU apart from what it awaited
        # (consumer.pipeline.handler_time).
        timed: Stepped[T] | None = None
        follow_ups = self._follow_ups
        publishes = follow_ups.open(items) if follow_ups is not None else None
        try:
            try:
                task = calls.enter(running)
                try:
                    async with deadline:
                        timed = Stepped(call())
                        result = await timed
                        # Under the handler's time limit, as its own statements are (a slow or
                        # large write is the handler's doing; a stalled server is told apart by
                        # the time limit's probe). Never once it ended the transaction: the rows
                        # would commit alone (the check below fails the call).
                        if (
                            publishes is not None
                            and _published(publishes)
                            and conn.is_in_transaction()
                        ):
                            await self._write(conn, publishes, applied, result)
                finally:
                    calls.leave(task)
            except BaseException as raised:
                error = _as_exception(raised, handler.qualname)
                if error is None:
                    raise  # the worker itself is cancelled (a shutdown), or the process exits
                if not connection_lost(conn):
                    if not conn.is_in_transaction():
                        raise HandlerEndedTransaction.for_handler(handler.qualname) from error
                    if isinstance(error, asyncpg.InvalidTransactionTerminationError):
                        # The receipts' commit check (sql/004) fired early.
                        raise HandlerEndedTransaction.constraints_all_immediate(
                            handler.qualname
                        ) from error
                if error is raised:
                    raise
                raise error from raised
            if not conn.is_in_transaction():
                raise HandlerEndedTransaction.for_handler(handler.qualname)
            return result
        except TimeoutError as error:
            if deadline.expired:
                shown = format_duration(timedelta(seconds=limit))
                events = f" for {len(items)} events" if len(items) > 1 else ""
                raise HandlerTimeout(
                    f"{handler.qualname} ran past its {shown} limit{events}"
                ) from error
            raise
        except asyncpg.InsufficientPrivilegeError as error:
            # A missing grant is the deployment's fault, not the event's: stop rather than
            # dead-letter every event of this type.
            raise PipelineFault(f"{handler.qualname}: {error} (a grant is missing)") from error
        finally:
            if follow_ups is not None:
                follow_ups.close(items)
            wall = time.perf_counter() - started
            share = wall / len(items)
            for item in items:
                item.handler_seconds = share
            self._time.handler(batch=batch, wall=wall, cpu=timed.busy if timed else wall)

    async def _write(
        self,
        conn: asyncpg.Connection[Any],
        publishes: list[Publishes],
        applied: Callable[[T], Sequence[bool]] | None,
        result: T,
    ) -> None:
        """What the call published for the events it applied (``applied(result)``: which)."""
        assert self._follow_ups is not None
        if applied is not None:
            oks = applied(result)
            publishes = [one for one, ok in zip(publishes, oks, strict=True) if ok]
        await self._follow_ups.write(conn, publishes)


def _published(publishes: list[Publishes]) -> bool:
    """Whether the call published anything: most handlers never do, and skip the write."""
    return any(one.rows for one in publishes)


def _applied(results: list[Exception | None]) -> list[bool]:
    return [result is None for result in results]


def _as_exception(raised: BaseException, handler: str) -> Exception | None:
    """What a handler raised, as the event's failure; None for what must go on up: the process
    exiting, or a cancellation of the task itself (not one the handler met in a future or task
    of its own). Anything else that is not an Exception would otherwise end the worker."""
    if isinstance(raised, Exception):
        return raised
    if isinstance(raised, KeyboardInterrupt | SystemExit):
        return None
    if isinstance(raised, asyncio.CancelledError):
        task = asyncio.current_task()
        if task is not None and task.cancelling():
            return None
    return HandlerRaisedBaseException.for_handler(handler, raised)


def connection_lost(conn: asyncpg.Connection[Any]) -> bool:
    """Whether ``conn`` is gone (closed, or already taken back by the pool after it died)."""
    try:
        return conn.is_closed()
    except asyncpg.InterfaceError:
        return True
