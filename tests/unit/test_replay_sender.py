"""Replay's sender: the publishes asked for in one loop turn go out in one write, each tracked in
aiormq's own confirm tables; a nack fails its letter, and a closed channel writes nothing."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from datetime import timedelta
from typing import Any

import aiormq
import pytest
from aiormq.base import FutureStore
from pamqp import frame as amqp_frame
from pamqp.body import ContentBody
from pamqp.commands import Basic

from consumer.cli.dlq.replay_sender import ReplaySender
from consumer.errors import PublishFailed


class Connection:
    """Blocked by the broker until :meth:`unblock`, when ``blocked``."""

    def __init__(self, *, blocked: bool = False) -> None:
        self._unblocked = asyncio.Event()
        if not blocked:
            self._unblocked.set()

    async def ready(self) -> None:
        await self._unblocked.wait()

    def unblock(self) -> None:
        self._unblocked.set()


class Channel:
    """The parts of an aiormq channel in confirm mode that a publish touches."""

    def __init__(self, *, closed: bool = False, blocked: bool = False) -> None:
        self.connection = Connection(blocked=blocked)
        self.is_closed = closed
        self.number = 3
        self.delivery_tag = 0
        self.confirmations: dict[int, asyncio.Future[Any]] = {}
        self.message_id_delivery_tag: dict[str, int] = {}
        self.write_queue: asyncio.Queue[Any] = asyncio.Queue()
        self._lock = asyncio.Lock()

    @property
    @asynccontextmanager
    async def lock(self) -> AsyncIterator[None]:
        if self.is_closed:
            raise aiormq.exceptions.ChannelInvalidStateError("closed")
        async with self._lock:
            yield

    def create_future(self) -> asyncio.Future[Any]:
        future = asyncio.get_running_loop().create_future()
        if self.is_closed:
            future.set_exception(aiormq.exceptions.ChannelInvalidStateError("closed"))
        return future

    def _split_body(self, body: bytes) -> list[ContentBody]:
        return [ContentBody(body)]

    def written(self) -> list[list[Any]]:
        """Each write's frames, decoded."""
        writes = []
        while not self.write_queue.empty():
            payload = self.write_queue.get_nowait().payload
            frames = []
            while payload:
                used, _, frame = amqp_frame.unmarshal(payload)
                frames.append(frame)
                payload = payload[used:]
            writes.append(frames)
        return writes


def start(sender: ReplaySender, ident: str) -> asyncio.Task[None]:
    properties = Basic.Properties(message_id=ident, delivery_mode=2)
    return asyncio.create_task(
        sender.send(ident.encode(), properties, exchange="x.events", routing_key="t")
    )


async def settle(channel: Channel, tasks: list[asyncio.Task[None]]) -> list[Any]:
    while len(channel.confirmations) < len(tasks):
        await asyncio.sleep(0)
    for tag, confirmation in channel.confirmations.items():
        if tag == 2:
            confirmation.set_exception(aiormq.exceptions.DeliveryError(None, Basic.Nack(tag)))
        else:
            confirmation.set_result(Basic.Ack(tag))
    return await asyncio.gather(*tasks, return_exceptions=True)


async def test_publishes_of_one_turn_go_in_one_write_and_each_is_settled_by_its_confirm() -> None:
    # Given three publishes asked for before the loop comes round
    channel = Channel()
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=10))
    tasks = [start(sender, f"m{n}") for n in (1, 2, 3)]

    # When the broker acks the first and third and nacks the second
    outcomes = await settle(channel, tasks)

    # Then they went out in one write, tagged 1 to 3 in order, and only the nacked one failed
    [write] = channel.written()
    assert [type(f).__name__ for f in write] == ["Publish", "ContentHeader", "ContentBody"] * 3
    assert [f.value for f in write if isinstance(f, ContentBody)] == [b"m1", b"m2", b"m3"]
    assert all(f.mandatory for f in write if isinstance(f, Basic.Publish))
    assert channel.delivery_tag == 3
    assert outcomes[0] is None
    assert outcomes[2] is None
    assert isinstance(outcomes[1], PublishFailed)
    await asyncio.sleep(0)
    assert channel.message_id_delivery_tag == {}


async def test_a_closed_channel_writes_nothing_and_fails_the_publish() -> None:
    channel = Channel(closed=True)
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=10))

    with pytest.raises(PublishFailed):
        await start(sender, "m1")

    assert channel.written() == []
    assert channel.delivery_tag == 0
    assert channel.confirmations == {}


async def test_a_write_cancelled_before_it_is_queued_frees_its_tags_and_fails_its_letters() -> None:
    # Given a write queue that is full, so the write waits
    channel = Channel()
    channel.write_queue = asyncio.Queue(maxsize=1)
    channel.write_queue.put_nowait(None)
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=10))
    tasks = [start(sender, f"m{n}") for n in (1, 2)]
    while len(channel.confirmations) < 2:
        await asyncio.sleep(0)

    # When the write is cancelled (the replay stopped) before it was queued
    writing = next(
        task
        for task in asyncio.all_tasks()
        if getattr(task.get_coro(), "__qualname__", "") == "ReplaySender._write"
    )
    writing.cancel()
    outcomes = await asyncio.gather(*tasks, return_exceptions=True)

    # Then the broker never saw them: their tags are free and both letters failed
    assert channel.delivery_tag == 0
    assert channel.confirmations == {}
    assert channel.message_id_delivery_tag == {}
    assert all(isinstance(outcome, PublishFailed) for outcome in outcomes)


async def test_a_confirm_that_never_comes_fails_its_letter_after_the_deadline() -> None:
    channel = Channel()
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=0.05))

    with pytest.raises(PublishFailed, match=r"no confirm from the broker within 0\.05s"):
        await start(sender, "m1")

    assert channel.delivery_tag == 1


async def test_a_confirm_late_while_the_broker_blocks_the_connection_is_waited_for() -> None:
    # Given a connection the broker has blocked (an alarm), and a publish in flight
    channel = Channel(blocked=True)
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=0.05))
    task = start(sender, "m1")

    # When the confirm comes only after several deadlines, once the alarm is over
    await asyncio.sleep(0.3)
    assert not task.done()
    channel.connection.unblock()
    channel.confirmations[1].set_result(Basic.Ack(1))

    # Then the letter is replayed
    await task
    assert task.exception() is None


async def test_a_confirm_cut_off_by_a_closing_connection_fails_its_letter_not_the_replay() -> None:
    # Given a publish written and waiting for its confirm
    channel = Channel()
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=10))
    sending = start(sender, "m1")
    while not channel.confirmations:
        await asyncio.sleep(0)

    # When the connection closes as aiormq closes it once the heartbeat ran out: its pending
    # futures fail with the CancelledError that stopped its reader
    for confirmation in channel.confirmations.values():
        confirmation.set_exception(asyncio.CancelledError())

    # Then the publish failed (its letter stays), and the replay's task was not cancelled
    with pytest.raises(PublishFailed, match="closed"):
        await sending
    assert not sending.cancelled()


async def test_a_publish_waits_while_another_of_its_message_id_is_in_flight() -> None:
    # Given two letters sharing a message id (aiormq matches a return by message id alone)
    channel = Channel()
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=10))
    first, second = start(sender, "m1"), start(sender, "m1")
    while not channel.confirmations:
        await asyncio.sleep(0)

    # When the first is still unconfirmed, only it is on the wire; once confirmed, the second goes
    for _ in range(5):
        await asyncio.sleep(0)
    assert [len(write) for write in channel.written()] == [3]
    assert channel.message_id_delivery_tag == {"m1": 1}
    channel.confirmations[1].set_result(Basic.Ack(1))
    await first
    while len(channel.confirmations) < 2:
        await asyncio.sleep(0)
    assert channel.message_id_delivery_tag == {"m1": 2}
    channel.confirmations[2].set_result(Basic.Ack(2))
    await second
    assert [len(write) for write in channel.written()] == [3]


async def test_a_confirm_rejected_by_a_connection_closed_without_a_reason_fails_its_letter() -> (
    None
):
    # Given a publish written, its confirm in aiormq's own future store
    futures = FutureStore(asyncio.get_running_loop())
    channel = Channel()
    channel.create_future = futures.create_future  # type: ignore[method-assign]
    sender = ReplaySender(channel, confirm_within=timedelta(seconds=10))
    sending = start(sender, "m1")
    while not channel.confirmations:
        await asyncio.sleep(0)

    # When the connection closes as aiormq closes one whose reader ended without an error: its
    # futures fail with a bare Exception
    await futures.reject_all(None)

    # Then the publish failed, so its letter is counted failed (and stays), not lost to the tally
    with pytest.raises(PublishFailed, match="closed"):
        await sending


def test_a_channel_without_the_aiormq_tables_it_relies_on_is_refused_at_once() -> None:
    # Given a channel of an aiormq that keeps its confirm tables elsewhere
    channel = Channel()
    del channel.message_id_delivery_tag

    # Then no sender is made: not a replay whose publishes never settle
    with pytest.raises(TypeError, match="message_id_delivery_tag"):
        ReplaySender(channel, confirm_within=timedelta(seconds=10))
