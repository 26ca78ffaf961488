"""The isolated deliveries: nothing else of the process is in flight while one is applied."""

from __future__ import annotations

import asyncio

from consumer.service.isolated import IsolatedQueue


async def test_an_isolated_turn_waits_for_batches_in_flight_and_keeps_new_ones_out() -> None:
    isolation: IsolatedQueue[str] = IsolatedQueue()
    log: list[str] = []
    release_first = asyncio.Event()

    async def first_batch() -> None:
        async with isolation.batch():
            log.append("batch 1 starts")
            await release_first.wait()
            log.append("batch 1 ends")

    async def isolated() -> None:
        await isolation.wait_for_work()
        async with isolation.turn():
            while (item := isolation.take()) is not None:
                log.append(f"alone {item}")
                await asyncio.sleep(0.01)

    async def second_batch() -> None:
        async with isolation.batch():
            log.append("batch 2")

    batch = asyncio.create_task(first_batch())
    await asyncio.sleep(0)
    runner = asyncio.create_task(isolated())
    isolation.put("a")
    isolation.put("b")
    later = asyncio.create_task(second_batch())
    await asyncio.sleep(0.01)
    assert log == ["batch 1 starts"]  # the isolated turn waits, and so does the new batch
    release_first.set()
    await asyncio.wait_for(asyncio.gather(batch, later), 1)
    assert log == ["batch 1 starts", "batch 1 ends", "alone a", "alone b", "batch 2"]
    runner.cancel()


async def test_draining_takes_everything_queued() -> None:
    isolation: IsolatedQueue[int] = IsolatedQueue()
    for item in range(3):
        isolation.put(item)
    assert len(isolation) == 3
    assert isolation.take_all() == [0, 1, 2]
    assert isolation.take() is None
