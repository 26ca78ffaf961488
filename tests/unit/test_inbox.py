"""How a worker's inbox forms batches: what is ready, and a short wait only under a backlog."""

from __future__ import annotations

import asyncio
import time

from consumer.service.inbox import Inbox


async def test_a_batch_is_what_is_ready_up_to_the_size() -> None:
    inbox: Inbox[int] = Inbox(size=3, wait=0)
    for item in range(5):
        inbox.put(item)
    assert await inbox.next_batch() == [0, 1, 2]
    assert await inbox.next_batch() == [3, 4]
    assert len(inbox) == 0


async def test_an_idle_worker_takes_the_next_arrival_and_goes() -> None:
    inbox: Inbox[str] = Inbox(size=10, wait=60.0)
    taking = asyncio.create_task(inbox.next_batch())
    await asyncio.sleep(0.01)  # the worker is blocked on an empty inbox
    inbox.put("alone")
    # Under a backlog it would wait the full minute for company: this would time out.
    assert await asyncio.wait_for(taking, 10) == ["alone"]


async def test_with_a_backlog_it_waits_for_company_up_to_the_size() -> None:
    inbox: Inbox[int] = Inbox(size=5, wait=60.0)
    inbox.put(0)  # waiting before the worker asks: the worker is the bottleneck
    taking = asyncio.create_task(inbox.next_batch())
    await asyncio.sleep(0.05)
    assert not taking.done()  # waits for company instead of going alone
    for item in range(1, 7):
        inbox.put(item)
    assert await asyncio.wait_for(taking, 30) == [0, 1, 2, 3, 4]
    assert inbox.take_all() == [5, 6]


async def test_the_wait_ends_at_its_deadline_with_what_came() -> None:
    inbox: Inbox[int] = Inbox(size=50, wait=0.2)
    inbox.put(0)
    inbox.put(1)
    started = time.monotonic()
    assert await asyncio.wait_for(inbox.next_batch(), 30) == [0, 1]
    assert time.monotonic() - started >= 0.15  # it did wait, and gave up at the deadline


async def test_a_worker_cancelled_while_it_waits_leaves_everything_queued() -> None:
    inbox: Inbox[int] = Inbox(size=10, wait=60.0)
    inbox.put(0)
    taking = asyncio.create_task(inbox.next_batch())
    await asyncio.sleep(0.01)
    inbox.put(1)
    taking.cancel()
    await asyncio.gather(taking, return_exceptions=True)
    assert inbox.take_all() == [0, 1]  # shutdown returns them to the broker


async def test_an_empty_wait_that_is_cancelled_lets_the_next_one_work() -> None:
    inbox: Inbox[int] = Inbox(size=2, wait=0)
    taking = asyncio.create_task(inbox.next_batch())
    await asyncio.sleep(0.01)
    taking.cancel()
    await asyncio.gather(taking, return_exceptions=True)
    inbox.put(7)
    assert await asyncio.wait_for(inbox.next_batch(), 30) == [7]


async def test_with_the_prefetch_window_full_a_backlog_goes_without_waiting() -> None:
    # The broker sends nothing more until something settles: waiting for company is waiting for
    # nothing (at a small prefetch, the whole difference from a consumer that acks each message)
    inbox: Inbox[int] = Inbox(size=50, wait=60.0, more_coming=lambda: False)
    inbox.put(0)
    inbox.put(1)
    assert await asyncio.wait_for(inbox.next_batch(), 10) == [0, 1]


async def test_a_wait_ends_when_the_window_fills_meanwhile() -> None:
    inbox: Inbox[int] = Inbox(size=50, wait=60.0)
    inbox.put(0)
    taking = asyncio.create_task(inbox.next_batch())
    await asyncio.sleep(0.01)
    assert not taking.done()
    inbox.put(1)
    inbox.wake()  # the dispatcher: that delivery was the last the window lets in
    assert await asyncio.wait_for(taking, 10) == [0, 1]


async def test_after_settling_a_full_window_the_first_arrival_waits_for_the_refill() -> None:
    # The broker refills a window one delivery after another: going with the first would leave
    # the rest to batches of one or two.
    inbox: Inbox[int] = Inbox(size=3, wait=60.0)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True))
    await asyncio.sleep(0.01)
    inbox.put(0)
    await asyncio.sleep(0.05)
    assert not taking.done()
    inbox.put(1)
    inbox.put(2)
    assert await asyncio.wait_for(taking, 30) == [0, 1, 2]


async def test_a_refill_wait_ends_when_the_window_is_full_again() -> None:
    window_full = False
    inbox: Inbox[int] = Inbox(size=10, wait=60.0, more_coming=lambda: not window_full)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True))
    await asyncio.sleep(0.01)
    inbox.put(0)
    await asyncio.sleep(0.01)
    window_full = True  # the rest of the refill went to other workers' inboxes
    inbox.wake()
    assert await asyncio.wait_for(taking, 30) == [0]


async def test_a_refill_flag_goes_stale_once_the_worker_has_idled_past_a_wait() -> None:
    # No refill came (the queue ran dry): an event long after is a lone one and goes at once
    inbox: Inbox[str] = Inbox(size=10, wait=0.05)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True))
    await asyncio.sleep(0.2)
    inbox.put("late")
    started = time.monotonic()
    assert await asyncio.wait_for(taking, 10) == ["late"]
    assert time.monotonic() - started < 0.04
