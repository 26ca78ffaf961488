"""The hard time limit: a thread outside the event loop that ends the process when the loop stops.

The soft limit (``asyncio.timeout`` around each handler) cannot fire while a handler blocks the loop
in synchronous code. This thread watches a heartbeat the loop writes; when it is older than
``CONSUMER_HARD_TIMEOUT`` it logs which event the loop was in and exits the process at once, so the
broker redelivers and the supervisor restarts the service. The work queue's delivery limit ends a
loop of such crashes.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable, Iterator
from types import FrameType, TracebackType
from typing import Any

from consumer.logs import Logger

EXIT_HARD_TIMEOUT = 3


def _frames(frame: FrameType | None) -> Iterator[FrameType]:
    while frame is not None:
        yield frame
        frame = frame.f_back


def event_in_frame(frame: FrameType | None) -> dict[str, Any]:
    """The event a blocked loop was applying, found in the pipeline's frame on its stack.

    For a batch handler's call, the first event of the call and how many it holds.
    """
    for current in _frames(frame):
        name = current.f_code.co_name
        if name == "_run_handler":
            item = current.f_locals.get("item")
            found: dict[str, Any] = {}
        elif name == "_run_batch_handler":
            items = current.f_locals.get("items") or [None]
            item = items[0]
            found = {"batch_events": len(items)}
        else:
            continue
        event = getattr(item, "event", None)
        delivery = getattr(item, "delivery", None)
        handler = getattr(item, "handler", None)
        return {
            "event_id": str(getattr(event, "event_id", None)),
            "type": getattr(event, "type", None),
            "message_id": getattr(delivery, "message_id", None),
            "handler": getattr(handler, "qualname", None),
            **found,
        }
    return {}


class LoopWatchdog:
    """Ends the process (exit code 3) if the event loop is blocked longer than ``limit`` seconds."""

    def __init__(
        self,
        *,
        limit: float,
        logger: Logger,
        interval: float | None = None,
        before_exit: Callable[[], None] = lambda: None,
    ) -> None:
        self._limit = limit
        self._logger = logger
        self._before_exit = before_exit
        self._interval = interval if interval is not None else min(0.5, limit / 4)
        self._beat = time.monotonic()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._loop_thread_id = 0

    async def __aenter__(self) -> LoopWatchdog:
        self._loop_thread_id = threading.get_ident()
        self._beat = time.monotonic()
        self._heartbeat = asyncio.create_task(self._beat_forever(), name="watchdog-heartbeat")
        self._thread = threading.Thread(target=self._watch, name="loop-watchdog", daemon=True)
        self._thread.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._stopped.set()
        if self._heartbeat is not None:
            self._heartbeat.cancel()
        if self._thread is not None:
            self._thread.join(timeout=2)

    async def _beat_forever(self) -> None:
        while True:
            self._beat = time.monotonic()
            await asyncio.sleep(self._interval)

    def _watch(self) -> None:
        while not self._stopped.wait(self._interval):
            blocked = time.monotonic() - self._beat
            if blocked <= self._limit:
                continue
            frame = sys._current_frames().get(self._loop_thread_id)
            # What the loop logged before it blocked goes out first (it waits for a turn's end).
            self._before_exit()
            self._logger.critical(
                "event loop blocked past the hard time limit; exiting so the broker redelivers",
                blocked_s=round(blocked, 2),
                hard_limit_s=self._limit,
                **event_in_frame(frame),
            )
            sys.stdout.flush()
            os._exit(EXIT_HARD_TIMEOUT)
