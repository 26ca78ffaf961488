"""The hard time limit's watchdog against a process stopped as a whole (SIGSTOP, a paused
container or VM): on a clock of the test's, which jumps as such a stop looks from inside; and
against a loop blocked in C code that keeps the GIL, which delays the watchdog's looks as long."""

from __future__ import annotations

import asyncio
import io
import os
import re
import threading
import time

import pytest

from consumer.logs import make_logger
from consumer.service import watchdog
from consumer.service.watchdog import LoopWatchdog

LIMIT = 1.0
INTERVAL = 0.01


class Clock:
    """A monotonic clock that moves only when told."""

    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


class Exited(BaseException):
    """What the patched ``os._exit`` raises in the watchdog's thread (ending it)."""


@pytest.fixture
def exits(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The exit codes the watchdog asked for, instead of ending the test run."""
    codes: list[int] = []

    def exit_(code: int) -> None:
        codes.append(code)
        raise Exited

    monkeypatch.setattr(os, "_exit", exit_)
    monkeypatch.setattr(threading, "excepthook", lambda _: None)
    return codes


async def looks(count: int) -> None:
    """Let the watchdog's thread look ``count`` times, the loop beating between."""
    for _ in range(count):
        await asyncio.sleep(INTERVAL)


async def test_a_process_stopped_past_the_limit_is_not_a_blocked_loop(exits: list[int]) -> None:
    clock = Clock()
    logger = make_logger("watchdog-test", log_format="console", stream=io.StringIO())
    still = Clock()  # the loop's thread uses no CPU while the process is stopped
    async with LoopWatchdog(
        limit=LIMIT, logger=logger, interval=INTERVAL, clock=clock, cpu_clock=still
    ):
        await looks(5)
        # The whole process stops for 30s: both the loop's heartbeat and the watchdog's last
        # look are 30s old when it runs again, and the watchdog looks before the loop beats
        clock.now += 30
        time.sleep(INTERVAL * 10)
        await looks(20)

    assert exits == []


async def test_a_loop_that_does_not_beat_past_the_limit_still_ends_the_process(
    exits: list[int],
) -> None:
    clock = Clock()
    stream = io.StringIO()
    logger = make_logger("watchdog-test", log_format="console", stream=stream)
    stop = threading.Event()

    def time_passes() -> None:
        # In steps shorter than the limit: the watchdog's thread is running all along
        while not stop.wait(INTERVAL * 2):
            clock.now += 0.3

    async with LoopWatchdog(limit=LIMIT, logger=logger, interval=INTERVAL, clock=clock):
        await looks(5)
        ticking = threading.Thread(target=time_passes)
        ticking.start()
        try:
            # The loop blocks (no heartbeat) until the watchdog has asked to exit
            for _ in range(3_000):
                if exits:
                    break
                time.sleep(INTERVAL)
        finally:
            stop.set()
            ticking.join()

    assert exits == [watchdog.EXIT_HARD_TIMEOUT]
    assert "event loop blocked past the hard time limit" in stream.getvalue()


async def test_a_late_look_after_a_busy_loop_is_not_a_stopped_process(exits: list[int]) -> None:
    clock = Clock()
    cpu = Clock()
    stream = io.StringIO()
    logger = make_logger("watchdog-test", log_format="console", stream=stream)
    async with LoopWatchdog(
        limit=LIMIT, logger=logger, interval=INTERVAL, clock=clock, cpu_clock=cpu
    ):
        await looks(5)
        # The loop computes for 30s in a call that keeps the GIL: the watchdog's next look comes
        # 30s late, as after a stop, but the loop's thread spent those 30s on the CPU
        clock.now += 30
        cpu.now += 30
        for _ in range(3_000):
            if exits:
                break
            time.sleep(INTERVAL)

    assert exits == [watchdog.EXIT_HARD_TIMEOUT]
    assert "event loop blocked past the hard time limit" in stream.getvalue()


_BACKTRACKS = re.compile(r"(a+)+$")


def _hold_the_gil(size: int) -> None:
    """A regular expression backtracking: C code that keeps the GIL until it returns."""
    _BACKTRACKS.match("a" * size + "b")


def _size_for(cpu_seconds: float) -> int:
    """A size for :func:`_hold_the_gil` that costs at least ``cpu_seconds`` of this thread's
    CPU (not of wall time: a loaded machine makes it longer, never shorter)."""
    size = 16
    while True:
        started = time.thread_time()
        _hold_the_gil(size)
        if time.thread_time() - started >= cpu_seconds:
            return size
        size += 1


async def test_a_loop_held_in_calls_that_keep_the_gil_still_ends_the_process(
    exits: list[int],
) -> None:
    limit, interval = 0.2, 0.05
    size = _size_for(cpu_seconds=0.5)  # well past the limit and what a stop may spend
    logger = make_logger("watchdog-test", log_format="console", stream=io.StringIO())
    async with LoopWatchdog(limit=limit, logger=logger, interval=interval):
        await asyncio.sleep(interval * 4)
        # Each call keeps the watchdog's thread from looking until it returns: every look it
        # gets comes past the limit after the one before, as after a stop
        for _ in range(5):
            if exits:
                break
            _hold_the_gil(size)
        # The loop beats again: only a late look the watchdog still owes can end the process
        await asyncio.sleep(interval * 4)

    assert exits == [watchdog.EXIT_HARD_TIMEOUT]
