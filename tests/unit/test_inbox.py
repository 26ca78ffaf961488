"""How a worker's inbox forms batches, group-commit style: what is waiting goes at once, and only
a prefetch window's refill is waited for, as long as its deliveries keep coming."""

from __future__ import annotations

import asyncio

from consumer.service.inbox import Inbox


async def test_a_batch_is_what_is_ready_up_to_the_size() -> None:
    inbox: Inbox[int] = Inbox(size=3, wait=0)
    for item in range(5):
        inbox.put(item)
    assert await inbox.next_batch() == [0, 1, 2]
    assert await inbox.next_batch() == [3, 4]
    assert len(inbox) == 0


async def test_an_idle_worker_takes_the_next_arrival_and_goes() -> None:
    inbox: Inbox[str] = Inbox(size=10, wait=60.0, max_linger=60.0, min_gap_wait=60.0)
    taking = asyncio.create_task(inbox.next_batch(batch_seconds=60.0))
    await asyncio.sleep(0.01)  # the worker is blocked on an empty inbox
    inbox.put("alone")
    # Were it to wait for company it would wait a minute: this would time out.
    assert await asyncio.wait_for(taking, 10) == ["alone"]


async def test_what_arrived_during_the_last_commit_is_the_next_batch_at_once() -> None:
    # Group commit: a worker coming back from a commit takes what is waiting and goes; the batch
    # grew only because deliveries came faster than the transaction committed.
    inbox: Inbox[int] = Inbox(size=5, wait=60.0, max_linger=60.0, min_gap_wait=60.0)
    inbox.put(0)
    inbox.put(1)
    assert await asyncio.wait_for(inbox.next_batch(batch_seconds=60.0), 10) == [0, 1]


async def test_the_size_can_change_between_batches() -> None:
    inbox: Inbox[int] = Inbox(size=5)
    for item in range(6):
        inbox.put(item)
    inbox.size = 2
    assert await inbox.next_batch() == [0, 1]
    inbox.size = 10
    assert await inbox.next_batch() == [2, 3, 4, 5]


async def test_an_empty_wait_that_is_cancelled_lets_the_next_one_work() -> None:
    inbox: Inbox[int] = Inbox(size=2, wait=0)
    taking = asyncio.create_task(inbox.next_batch())
    await asyncio.sleep(0.01)
    taking.cancel()
    await asyncio.gather(taking, return_exceptions=True)
    inbox.put(7)
    assert await asyncio.wait_for(inbox.next_batch(), 30) == [7]


async def test_after_settling_a_full_window_the_first_arrival_waits_for_the_refill() -> None:
    # The broker refills a window one delivery after another: going with the first would leave
    # the rest to batches of one or two.
    inbox: Inbox[int] = Inbox(size=3, max_linger=60.0, min_gap_wait=60.0)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True, batch_seconds=60.0))
    await asyncio.sleep(0.01)
    inbox.put(0)
    await asyncio.sleep(0.05)
    assert not taking.done()
    inbox.put(1)
    inbox.put(2)
    assert await asyncio.wait_for(taking, 30) == [0, 1, 2]


async def test_a_worker_cancelled_while_it_waits_for_a_refill_leaves_everything_queued() -> None:
    inbox: Inbox[int] = Inbox(size=10, max_linger=60.0, min_gap_wait=60.0)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True, batch_seconds=60.0))
    await asyncio.sleep(0.01)
    inbox.put(0)
    await asyncio.sleep(0.01)
    inbox.put(1)
    taking.cancel()
    await asyncio.gather(taking, return_exceptions=True)
    assert inbox.take_all() == [0, 1]  # shutdown returns them to the broker


async def test_a_refill_wait_ends_when_its_deliveries_stop_coming() -> None:
    # No second delivery within the gap: the refill is in (other workers took the rest).
    inbox: Inbox[int] = Inbox(size=10, max_linger=60.0, min_gap_wait=0.0)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True, batch_seconds=60.0))
    await asyncio.sleep(0.01)
    inbox.put(0)
    assert await asyncio.wait_for(taking, 30) == [0]


async def test_a_refill_wait_ends_when_the_window_is_full_again() -> None:
    window_full = False
    inbox: Inbox[int] = Inbox(
        size=10, max_linger=60.0, min_gap_wait=60.0, more_coming=lambda: not window_full
    )
    taking = asyncio.create_task(inbox.next_batch(refill_due=True, batch_seconds=60.0))
    await asyncio.sleep(0.01)
    inbox.put(0)
    await asyncio.sleep(0.01)
    window_full = True  # the rest of the refill went to other workers' inboxes
    inbox.wake()
    assert await asyncio.wait_for(taking, 30) == [0]


async def test_a_refill_is_never_waited_for_past_the_set_batch_wait() -> None:
    inbox: Inbox[int] = Inbox(size=10, wait=0, max_linger=60.0, min_gap_wait=60.0)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True, batch_seconds=60.0))
    await asyncio.sleep(0.01)
    inbox.put(0)
    assert await asyncio.wait_for(taking, 30) == [0]  # CONSUMER_BATCH_WAIT=0s: never waits


async def test_the_linger_is_bounded_by_the_measured_batch_time_and_the_setting() -> None:
    assert Inbox(size=1, max_linger=60.0).linger_for(0.002) == 0.002
    assert Inbox(size=1, wait=0.001, max_linger=60.0).linger_for(0.002) == 0.001
    assert Inbox(size=1, max_linger=0.05).linger_for(5.0) == 0.05


async def test_a_refill_flag_goes_stale_once_the_worker_has_idled_past_a_wait() -> None:
    # No refill came (the queue ran dry): an event long after is a lone one and goes at once
    inbox: Inbox[str] = Inbox(size=10, max_linger=60.0, min_gap_wait=60.0)
    taking = asyncio.create_task(inbox.next_batch(refill_due=True, batch_seconds=0.05))
    await asyncio.sleep(0.2)
    inbox.put("late")
    assert await asyncio.wait_for(taking, 10) == ["late"]


async def test_the_gap_between_arrivals_is_measured() -> None:
    inbox: Inbox[int] = Inbox(size=10)
    for item in range(50):
        inbox.put(item)
    assert inbox.arrival_gap < 0.001  # back to back
