"""A handler's time split into what it ran (holding the loop) and what it awaited."""

from __future__ import annotations

import asyncio
import time

import pytest

from consumer.pipeline.handler_time import HandlerTime, Stepped


async def _awaits_then_computes(awaited: float, computed: float) -> str:
    await asyncio.sleep(awaited)
    until = time.perf_counter() + computed
    while time.perf_counter() < until:
        pass
    return "done"


async def test_the_steps_count_what_ran_not_what_was_awaited() -> None:
    timed = Stepped(_awaits_then_computes(0.2, 0.02))
    assert await timed == "done"
    assert 0.02 <= timed.busy < 0.2  # the sleep is not in it


async def test_what_a_handler_raises_goes_through() -> None:
    async def fails() -> None:
        await asyncio.sleep(0)
        raise ValueError("bad")

    with pytest.raises(ValueError, match="bad"):
        await Stepped(fails())


async def test_a_cancellation_reaches_the_handler() -> None:
    cancelled = asyncio.Event()

    async def waits() -> None:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    async def run() -> None:
        await Stepped(waits())

    task = asyncio.create_task(run())
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)
    assert cancelled.is_set()
    assert task.cancelled()


def test_the_tally_splits_per_event_and_batch_handlers() -> None:
    tally = HandlerTime()
    tally.handler(batch=False, wall=0.010, cpu=0.002)
    tally.handler(batch=True, wall=0.005, cpu=0.001)
    tally.batch(events=3, seconds=0.020, cpu=0.004)
    window = tally.take()
    assert window.event_awaited == pytest.approx(0.008)
    assert window.event_cpu == pytest.approx(0.002)
    assert window.batch_handler_seconds == pytest.approx(0.005)
    assert (window.events, window.batches, window.batch_cpu) == (3, 1, 0.004)
    assert tally.peek().events == 0  # a new window
