"""The hard time limit: a thread outside the event loop that ends the process when the loop stops.

The soft limit (``asyncio.timeout`` around each handler) cannot fire while a handler blocks the loop
in synchronous code. This thread watches a heartbeat the loop writes; when it is older than
``CONSUMER_HARD_TIMEOUT`` it finds the handler call the loop is stuck in
(:mod:`consumer.pipeline.calls`), has the event convicted (``convict``: recorded in the database, so
that the event is dead-lettered at its next delivery instead of killing the next process too), logs
it and exits the process at once, so the broker redelivers and the supervisor restarts the service.

A process that was stopped as a whole (SIGSTOP, a paused container or virtual machine) finds its
heartbeat old when it runs again, though its loop never blocked: this thread was stopped as long.
So a look that comes more than the limit after the one before restarts the count from then, if
the loop's thread used next to no CPU meanwhile. A look comes late for another reason too: the loop
blocked in C code that keeps the GIL (a regular expression backtracking, ``json.loads`` of a huge
text) leaves this thread no turn until it returns. That loop was busy, not stopped: its thread's CPU
time shows it, and the count goes on (else a handler that blocks the loop in such calls, one after
another, would never be stopped).
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from types import TracebackType

from consumer.logs import Logger
from consumer.pipeline.calls import HandlerCalls, RunningCall

__all__ = ["EXIT_HARD_TIMEOUT", "Convict", "LoopWatchdog", "thread_cpu_clock"]

EXIT_HARD_TIMEOUT = 3

Convict = Callable[[RunningCall, float], bool]
"""Record that ``call`` blocked the loop for that many seconds; True once it is recorded."""


class LoopWatchdog:
    """Ends the process (exit code 3) if the event loop is blocked longer than ``limit`` seconds."""

    def __init__(
        self,
        *,
        limit: float,
        logger: Logger,
        calls: HandlerCalls | None = None,
        convict: Convict | None = None,
        interval: float | None = None,
        before_exit: Callable[[], None] = lambda: None,
        clock: Callable[[], float] = time.monotonic,
        cpu_clock: Callable[[], float] | None = None,
    ) -> None:
        self._limit = limit
        self._clock = clock
        # The loop's thread's CPU time (None: read from the thread that enters, the loop's).
        self._cpu_clock = cpu_clock
        self._logger = logger
        self._calls = calls or HandlerCalls()
        self._convict = convict
        self._before_exit = before_exit
        self._interval = interval if interval is not None else min(0.5, limit / 4)
        # The most CPU the loop's thread can use across a late look and still have been stopped:
        # it ran until the stop, at most an interval after the look before, and briefly after.
        self._stopped_cpu = 2 * self._interval
        self._beat = clock()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self._heartbeat: asyncio.Task[None] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> LoopWatchdog:
        self._loop = asyncio.get_running_loop()
        if self._cpu_clock is None:
            self._cpu_clock = thread_cpu_clock()
        self._beat = self._clock()
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
            self._beat = self._clock()
            await asyncio.sleep(self._interval)

    def _watch(self) -> None:
        seen: RunningCall | None = None
        cpu_clock = self._cpu_clock or time.process_time
        looked = resumed = self._clock()
        busy = cpu_clock()
        while not self._stopped.wait(self._interval):
            now = self._clock()
            cpu = cpu_clock()
            if now - looked > self._limit and cpu - busy <= self._stopped_cpu:
                # This thread went unscheduled past the limit too, and the loop's thread used
                # no CPU meanwhile: the whole process was stopped, not its loop blocked. The
                # loop gets the limit again from now.
                resumed = now
            looked, busy = now, cpu
            blocked = now - max(self._beat, resumed)
            if blocked <= self._limit:
                seen = None
                continue
            assert self._loop is not None
            call = self._calls.running(self._loop)
            if call is not None and call is not seen:
                # The heartbeat can be up to an interval old: the call that blocked past the
                # limit is the one still running at the next look, not one that just began.
                seen = call
                continue
            convicted = False
            # Only a call of one event names its culprit; a batch handler's call is applied again
            # event by event after the restart, where a second block names the event.
            if call is not None and len(call.event_ids) == 1 and self._convict is not None:
                convicted = self._convict(call, blocked)
            # What the loop logged before it blocked goes out first (it waits for a turn's end).
            self._before_exit()
            self._logger.critical(
                "event loop blocked past the hard time limit; exiting so the broker redelivers",
                blocked_s=round(blocked, 2),
                hard_limit_s=self._limit,
                convicted=convicted,
                **(call.describe() if call is not None else {}),
            )
            sys.stdout.flush()
            os._exit(EXIT_HARD_TIMEOUT)


def thread_cpu_clock() -> Callable[[], float]:
    """The calling thread's CPU time as a clock any thread can read; the process's where the
    platform has no per-thread clock (the loop's thread is the one that uses CPU anyway)."""
    try:
        clock_id = time.pthread_getcpuclockid(threading.get_ident())
    except (AttributeError, OSError):
        return time.process_time
    return lambda: time.clock_gettime(clock_id)
