"""The worker count and batch size chosen from what the handlers were measured to do."""

from __future__ import annotations

import asyncio

import pytest

from consumer.pipeline.handler_time import HandlerTime, HandlerTimeWindow
from consumer.service.concurrency_policy import (
    START_BATCH_SIZE,
    Choice,
    Limits,
    decide,
    initial,
    material,
)

DEFAULTS = Limits(prefetch=400, pool_size=4)
START = initial(DEFAULTS)


def _per_event(
    *,
    awaited_ms: float,
    cpu_ms: float,
    overhead_ms: float,
    batch: int,
    batches: int = 100,
    overhead_cpu_ms: float | None = None,
) -> HandlerTimeWindow:
    """Batches of ``batch`` per-event handler calls, each awaiting and computing, plus the
    transaction's own ``overhead_ms`` per batch (half of it holding the loop, unless told)."""
    if overhead_cpu_ms is None:
        overhead_cpu_ms = overhead_ms / 2
    time = HandlerTime()
    for _ in range(batches):
        for _ in range(batch):
            wall = (awaited_ms + cpu_ms) / 1000
            time.handler(batch=False, wall=wall, cpu=cpu_ms / 1000)
        seconds = batch * (awaited_ms + cpu_ms) / 1000 + overhead_ms / 1000
        cpu = (batch * cpu_ms + overhead_cpu_ms) / 1000
        time.batch(events=batch, seconds=seconds, cpu=cpu)
    return time.take()


def _batch_handler(*, per_batch_ms: float, overhead_ms: float, batch: int) -> HandlerTimeWindow:
    time = HandlerTime()
    for _ in range(20):
        time.handler(batch=True, wall=per_batch_ms / 1000, cpu=per_batch_ms / 2000)
        seconds = (per_batch_ms + overhead_ms) / 1000
        time.batch(events=batch, seconds=seconds, cpu=seconds / 3)
    return time.take()


def test_it_starts_with_one_worker_and_full_batches_at_the_defaults() -> None:
    assert (START.workers, START.batch_size) == (1, 50)


def test_a_handler_awaiting_io_gets_parallel_workers_and_small_batches() -> None:
    window = _per_event(awaited_ms=5, cpu_ms=0.1, overhead_ms=2, batch=50)
    choice = decide(DEFAULTS, window, START)
    assert choice.workers == 4  # the pool
    assert 1 <= choice.batch_size < 50
    assert choice.reason == "handlers await"


def test_a_slow_io_handler_gets_batches_of_one() -> None:
    window = _per_event(awaited_ms=50, cpu_ms=0.1, overhead_ms=2, batch=50)
    assert decide(DEFAULTS, window, START) == Choice(4, 1, "handlers await")


def test_a_database_only_batch_handler_keeps_one_worker_and_full_batches() -> None:
    window = _batch_handler(per_batch_ms=6, overhead_ms=2, batch=50)
    assert decide(DEFAULTS, window, START) == Choice(1, 50, "batch handlers")


def test_a_cpu_heavy_handler_keeps_one_worker_and_full_batches() -> None:
    window = _per_event(awaited_ms=0.01, cpu_ms=2, overhead_ms=2, batch=50)
    choice = decide(DEFAULTS, window, START)
    assert (choice.workers, choice.reason) == (1, "handlers do not await")
    assert choice.batch_size > 10  # the transaction's round trips a small share of 2 ms each


def test_a_handler_that_stops_awaiting_goes_back_to_one_worker() -> None:
    parallel = Choice(4, 2, "handlers await")
    window = _per_event(
        awaited_ms=0.0, cpu_ms=0.5, overhead_ms=2, overhead_cpu_ms=2, batch=2, batches=200
    )
    assert decide(DEFAULTS, window, parallel) == Choice(1, 50, "handlers do not await")


def test_workers_are_bounded_by_the_pool_and_the_prefetch_window() -> None:
    window = _per_event(awaited_ms=50, cpu_ms=0.1, overhead_ms=2, batch=1)
    assert decide(Limits(prefetch=400, pool_size=2), window, START).workers == 2
    assert decide(Limits(prefetch=3, pool_size=10), window, START).workers == 3


def test_batches_never_exceed_the_workers_share_of_the_window() -> None:
    # A fast awaiting handler wants big batches, but four workers share a window of 20.
    window = _per_event(awaited_ms=0.3, cpu_ms=0.01, overhead_ms=5, batch=5)
    choice = decide(Limits(prefetch=20, pool_size=4), window, START)
    assert choice.batch_size <= -(-20 // choice.workers)


@pytest.mark.parametrize("workers", [1, 3])
def test_consumer_workers_pins_the_worker_count(workers: int) -> None:
    limits = Limits(prefetch=400, pool_size=4, workers=workers)
    for window in (
        _per_event(awaited_ms=50, cpu_ms=0.1, overhead_ms=2, batch=50),
        _per_event(awaited_ms=0, cpu_ms=1, overhead_ms=2, batch=50),
    ):
        assert decide(limits, window, initial(limits)).workers == workers


def test_consumer_batch_size_pins_the_batch_size() -> None:
    limits = Limits(prefetch=400, pool_size=4, batch_size=7)
    window = _per_event(awaited_ms=50, cpu_ms=0.1, overhead_ms=2, batch=7)
    assert decide(limits, window, initial(limits)) == Choice(4, 7, "handlers await")


def test_both_pinned_is_the_settings_whatever_is_measured() -> None:
    limits = Limits(prefetch=400, pool_size=4, workers=2, batch_size=9)
    window = _per_event(awaited_ms=50, cpu_ms=0.1, overhead_ms=2, batch=9)
    assert initial(limits) == Choice(2, 9, "pinned")
    assert decide(limits, window, initial(limits)) == Choice(2, 9, "pinned")


def test_too_little_measured_decides_nothing() -> None:
    window = _per_event(awaited_ms=50, cpu_ms=0.1, overhead_ms=2, batch=1, batches=3)
    assert decide(DEFAULTS, window, START) is START


def test_a_handler_awaiting_part_of_its_time_gets_workers_for_that_share() -> None:
    # A batch awaiting about half of its time: two workers keep the loop busy, full batches.
    window = _per_event(awaited_ms=0.5, cpu_ms=0.5, overhead_ms=2, batch=50)
    choice = decide(DEFAULTS, window, START)
    assert (choice.workers, choice.reason) == (2, "handlers await")
    assert choice.batch_size > 25  # quick handlers: batches near the window's share


def test_a_database_only_per_event_handler_gets_workers_and_full_batches() -> None:
    # One statement each: a round trip awaited, a little Python.
    window = _per_event(awaited_ms=0.4, cpu_ms=0.1, overhead_ms=2, batch=50)
    choice = decide(DEFAULTS, window, START)
    assert choice.workers > 1
    assert choice.batch_size == -(-400 // choice.workers) or choice.batch_size == 50


def test_batch_sizes_close_together_are_the_same_choice() -> None:
    assert not material(Choice(4, 8, "handlers await"), Choice(4, 11, "handlers await"))
    assert material(Choice(4, 8, "handlers await"), Choice(4, 20, "handlers await"))
    assert material(Choice(4, 8, "handlers await"), Choice(3, 8, "handlers await"))


def test_a_window_holds_a_batch_and_its_own_handlers_calls_only() -> None:
    # Another worker's handler calls, its batch not done yet, wait for that batch.
    tally = HandlerTime()

    async def worker(awaited: float, done: bool) -> None:
        tally.handler(batch=False, wall=awaited, cpu=0.0)
        if done:
            tally.batch(events=1, seconds=awaited + 0.001, cpu=0.001)

    async def both() -> None:
        await asyncio.gather(worker(0.005, True), worker(0.050, False))

    asyncio.run(both())
    window = tally.take()
    assert window.event_awaited == 0.005
    assert window.event_calls == 1


def test_batch_handlers_start_at_the_base_workers_and_full_batches() -> None:
    assert Choice(1, 50, "start") == START


def test_per_event_handlers_start_at_every_worker_and_small_batches() -> None:
    # A handler awaiting 50 ms would spend 2.5 s on a first batch of 50 before anything is
    # decided; small batches are measured at once, and the policy moves on from there.
    limits = Limits(prefetch=400, pool_size=4, per_event_handlers=True)
    assert initial(limits) == Choice(4, START_BATCH_SIZE, "start")
    cpu_bound = _per_event(awaited_ms=0, cpu_ms=2, overhead_ms=2, batch=START_BATCH_SIZE)
    assert decide(limits, cpu_bound, initial(limits)).workers == 1


@pytest.mark.parametrize(
    ("limits", "expected"),
    [
        (Limits(prefetch=2, pool_size=4, per_event_handlers=True), Choice(2, 1, "start")),
        (
            Limits(prefetch=400, pool_size=4, workers=2, per_event_handlers=True),
            Choice(2, 5, "start"),
        ),
        (
            Limits(prefetch=400, pool_size=4, batch_size=20, per_event_handlers=True),
            Choice(4, 20, "start"),
        ),
    ],
)
def test_the_per_event_start_stays_within_the_window_and_the_pins(
    limits: Limits, expected: Choice
) -> None:
    assert initial(limits) == expected
