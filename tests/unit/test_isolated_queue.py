"""The isolated deliveries: nothing else of the process is in flight while one is applied."""

from __future__ import annotations

import asyncio

from consumer.service.isolated import IsolatedQueue, IsolationGate


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


async def test_queues_sharing_a_gate_isolate_across_the_whole_process() -> None:
    # Given two queues of one process sharing the gate, a batch in flight in the second
    gate = IsolationGate()
    first: IsolatedQueue[str] = IsolatedQueue(gate)
    second: IsolatedQueue[str] = IsolatedQueue(gate)
    log: list[str] = []
    release = asyncio.Event()

    async def second_batch(name: str, wait: bool) -> None:
        async with second.batch():
            log.append(f"{name} starts")
            if wait:
                await release.wait()
            log.append(f"{name} ends")

    async def isolated(queue: IsolatedQueue[str]) -> None:
        while True:
            await queue.wait_for_work()
            async with queue.turn():
                while (item := queue.take()) is not None:
                    log.append(f"alone {item} starts")
                    await asyncio.sleep(0.01)
                    log.append(f"alone {item} ends")

    in_flight = asyncio.create_task(second_batch("batch", wait=True))
    await asyncio.sleep(0)
    runners = [asyncio.create_task(isolated(first)), asyncio.create_task(isolated(second))]

    # When the first queue has a delivery to apply alone, then the second one too, and the
    # second queue's workers start another batch
    first.put("a")
    await asyncio.sleep(0)
    second.put("b")
    later = asyncio.create_task(second_batch("later", wait=False))
    await asyncio.sleep(0.02)

    # Then the first queue's turn waits for the other queue's batch in flight
    assert log == ["batch starts"]
    release.set()
    await asyncio.wait_for(asyncio.gather(in_flight, later), 1)
    # And each delivery is applied alone in the process, one turn at a time, before any new batch
    assert log == [
        "batch starts",
        "batch ends",
        "alone a starts",
        "alone a ends",
        "alone b starts",
        "alone b ends",
        "later starts",
        "later ends",
    ]
    for runner in runners:
        runner.cancel()


async def test_a_queue_of_its_own_gate_does_not_wait_for_another_s() -> None:
    # Without a shared gate (one queue per process, as before), another queue's batch is no
    # reason to wait
    other: IsolatedQueue[str] = IsolatedQueue()
    mine: IsolatedQueue[str] = IsolatedQueue()
    release = asyncio.Event()

    async def other_batch() -> None:
        async with other.batch():
            await release.wait()

    held = asyncio.create_task(other_batch())
    await asyncio.sleep(0)
    mine.put("a")
    async with mine.turn():
        assert mine.take() == "a"
    release.set()
    await held


async def test_a_batch_waiting_for_the_queued_ones_enters_once_they_are_taken_away() -> None:
    # A pause (or a lost connection) takes what is queued here: a batch that waited only for it
    # goes on, without waiting for some other batch or delivery to stir the gate.
    queue: IsolatedQueue[str] = IsolatedQueue()
    queue.put("a")
    entered = asyncio.Event()

    async def batch() -> None:
        async with queue.batch():
            entered.set()

    task = asyncio.create_task(batch())
    await asyncio.sleep(0)
    assert not entered.is_set()
    assert queue.take_all() == ["a"]
    await asyncio.wait_for(entered.wait(), 1)
    await task
