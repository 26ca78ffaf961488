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


async def test_queues_sharing_the_process_gate_are_isolated_from_each_other() -> None:
    # Given two queues of a queue table sharing the process's gate, queue b with a batch in flight
    gate = IsolationGate()
    a: IsolatedQueue[str] = IsolatedQueue(gate)
    b: IsolatedQueue[str] = IsolatedQueue(gate)
    log: list[str] = []
    release = asyncio.Event()

    async def batch_of_b(name: str, hold: bool) -> None:
        async with b.batch():
            log.append(f"{name} starts")
            if hold:
                await release.wait()
            log.append(f"{name} ends")

    async def isolated(queue: IsolatedQueue[str]) -> None:
        await queue.wait_for_work()
        async with queue.turn():
            while (item := queue.take()) is not None:
                log.append(f"alone {item} starts")
                await asyncio.sleep(0.01)
                log.append(f"alone {item} ends")

    first = asyncio.create_task(batch_of_b("b's batch", hold=True))
    await asyncio.sleep(0)
    # When a delivery of queue a must be applied isolated, and then one of queue b too
    runners = [asyncio.create_task(isolated(a)), asyncio.create_task(isolated(b))]
    a.put("a1")
    await asyncio.sleep(0)
    b.put("b1")
    later = asyncio.create_task(batch_of_b("b's next batch", hold=False))
    await asyncio.sleep(0.02)

    # Then a's turn waits for b's batch in flight (a death now could be the batch's), and b's
    # next batch waits too
    assert log == ["b's batch starts"]
    release.set()
    await asyncio.wait_for(later, 1)

    # and no two isolated deliveries of the two queues are ever in flight together
    assert log == [
        "b's batch starts",
        "b's batch ends",
        "alone a1 starts",
        "alone a1 ends",
        "alone b1 starts",
        "alone b1 ends",
        "b's next batch starts",
        "b's next batch ends",
    ]
    await first
    for runner in runners:
        runner.cancel()
