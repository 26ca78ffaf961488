"""A time limit for one await, as :func:`asyncio.timeout` sets it, at about half its cost.

Every batch runs five or six awaits under a limit (the pool's acquire, each of the service's
statements, the handler's call): :func:`asyncio.timeout` costs about 11 µs each on the service's
two cores, this about 5. It does what ``asyncio.timeout`` does for one ``async with``: when the
limit passes, the task is cancelled, and the ``CancelledError`` that brings comes out of the block
as ``TimeoutError``; a cancellation from elsewhere stays a cancellation.
"""

from __future__ import annotations

import asyncio
from types import TracebackType

__all__ = ["Deadline"]


class Deadline:
    """``async with Deadline(seconds):`` limits the block to ``seconds``; :attr:`expired` says
    whether the limit passed. One use per instance."""

    __slots__ = ("_cancelling", "_seconds", "_task", "_timer", "expired")

    def __init__(self, seconds: float) -> None:
        self._seconds = seconds
        self.expired = False

    async def __aenter__(self) -> Deadline:
        task = asyncio.current_task()
        if task is None:
            raise RuntimeError("Deadline must be used inside a task")
        self._task = task
        self._cancelling = task.cancelling()
        self._timer = task.get_loop().call_later(self._seconds, self._expire)
        return self

    def _expire(self) -> None:
        self.expired = True
        self._task.cancel()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._timer.cancel()
        # As asyncio.timeout: only the cancellation this limit asked for becomes TimeoutError.
        cancelled = exc_type is asyncio.CancelledError
        if self.expired and self._task.uncancel() <= self._cancelling and cancelled:
            raise TimeoutError from exc
