"""How a worker's inbox forms batches: what is ready, and a short wait only under steady load."""

from __future__ import annotations

import asyncio
import time

from consumer.inbox import Inbox


async def test_a_batch_is_what_is_ready_up_to_the_size() -> None:
    inbox: Inbox[int] = Inbox(size=3, wait=0)
    for item in range(5):
        inbox.put(item)
    assert await inbox.next_batch() == [0, 1, 2]
    assert await inbox.next_batch() == [3, 4]
    assert len(inbox) == 0


async def test_a_lone_arrival_is_not_held_back() -> None:
    inbox: Inbox[str] = Inbox(size=10, wait=60.0)
    inbox.put("alone")
    started = time.monotonic()
    assert await inbox.next_batch() == ["alone"]
    assert time.monotonic() - started < 30  # far below the minute it would wait under load


async def test_under_steady_arrivals_it_waits_for_company_up_to_the_size() -> None:
    inbox: Inbox[int] = Inbox(size=5, wait=5.0)
    for item in range(5):
        inbox.put(item)  # arrivals within the wait of each other: events are arriving fast
    assert await inbox.next_batch() == [0, 1, 2, 3, 4]

    inbox.put(5)
    taking = asyncio.create_task(inbox.next_batch())
    await asyncio.sleep(0.05)
    assert not taking.done()  # waits for company instead of going alone
    for item in range(6, 11):
        inbox.put(item)
    assert await asyncio.wait_for(taking, 1) == [5, 6, 7, 8, 9]
    assert inbox.drain() == [10]


async def test_the_wait_ends_at_its_deadline_with_what_came() -> None:
    inbox: Inbox[int] = Inbox(size=50, wait=0.2)
    inbox.put(0)
    inbox.put(1)
    started = time.monotonic()
    assert await asyncio.wait_for(inbox.next_batch(), 2) == [0, 1]
    assert time.monotonic() - started >= 0.15  # it did wait, and gave up at the deadline
