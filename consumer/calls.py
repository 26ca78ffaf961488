"""Which handler call each task is in, for the watchdog.

The watchdog runs in its own thread and looks only while the event loop is blocked: the task the
loop is stuck in is then the current task, and the call registered for it names the event whose
handler blocked the loop. A call is registered per task, not in one slot, because several
workers' calls are open at once and only one of them can be the one running.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any
from uuid import UUID

__all__ = ["HandlerCall", "HandlerCalls"]


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
            "event_id": str(self.event_ids[0]),
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
        self._by_task: dict[asyncio.Task[Any], HandlerCall] = {}

    @contextmanager
    def entered(self, call: HandlerCall) -> Iterator[None]:
        task = asyncio.current_task()
        if task is None:  # pragma: no cover - handlers always run in a task
            yield
            return
        self._by_task[task] = call
        try:
            yield
        finally:
            self._by_task.pop(task, None)

    def running(self, loop: asyncio.AbstractEventLoop) -> HandlerCall | None:
        """The call ``loop`` is in right now; safe from another thread while the loop is stuck."""
        task = asyncio.current_task(loop)
        return self._by_task.get(task) if task is not None else None
