"""The ack-coalescing rules, against a channel that records the frames it is asked to send."""

from __future__ import annotations

import asyncio

import pytest

from consumer.amqp.acker import Acker
from consumer.errors import ChannelGone


class RecordingChannel:
    def __init__(self) -> None:
        self.frames: list[tuple[str, int, bool]] = []
        self.is_closed = False

        self.slow = False

    async def basic_ack(self, tag: int, *, multiple: bool, wait: bool) -> None:
        if self.slow:
            await asyncio.sleep(0.01)  # the connection's write queue is full
        self.frames.append(("ack", tag, multiple))

    async def basic_nack(self, tag: int, *, multiple: bool, requeue: bool, wait: bool) -> None:
        assert not multiple
        if self.slow:
            await asyncio.sleep(0.01)
        self.frames.append(("nack-requeue" if requeue else "nack", tag, multiple))


async def settle() -> None:
    for _ in range(5):
        await asyncio.sleep(0)


async def make(
    *tags: int, max_delay: float = 0.05, window: int | None = None
) -> tuple[Acker, RecordingChannel, list[int]]:
    channel = RecordingChannel()
    lost: list[int] = []
    acker = Acker(channel, max_delay=max_delay, window=window, on_lost=lost.append)
    for tag in tags:
        acker.received(tag)
    return acker, channel, lost


async def test_contiguous_acks_go_out_as_one_multiple_ack() -> None:
    acker, channel, _ = await make(1, 2, 3, 4)
    for tag in (2, 1, 4, 3):
        acker.ack(tag)
    await settle()
    assert channel.frames == [("ack", 4, True)]


async def test_a_delivery_in_flight_blocks_the_multiple_ack_past_it() -> None:
    acker, channel, _ = await make(1, 2, 3, 4, max_delay=0.05)
    acker.ack(1)
    acker.ack(3)
    acker.ack(4)
    await settle()
    assert channel.frames == [("ack", 1, True)]
    await asyncio.sleep(0.1)  # 3 and 4 waited past max_delay behind 2: acked alone
    assert channel.frames == [("ack", 1, True), ("ack", 3, False), ("ack", 4, False)]
    acker.ack(2)
    await settle()
    assert channel.frames[-1] == ("ack", 2, True)


async def test_at_a_small_prefetch_deliveries_behind_one_in_flight_are_acked_at_once() -> None:
    # A prefetch of 8: two done deliveries are a quarter of what the broker may send, and it
    # sends nothing in their place until they are acked
    acker, channel, _ = await make(1, 2, 3, 4, max_delay=60.0, window=8)
    acker.ack(3)
    await settle()
    assert channel.frames == []  # one alone may wait for the multiple ack
    acker.ack(4)
    await settle()
    assert channel.frames == [("ack", 3, False), ("ack", 4, False)]


async def test_nacks_are_single_and_immediate_and_acks_skip_over_them() -> None:
    acker, channel, _ = await make(1, 2, 3)
    await acker.nack(2, requeue=False)
    acker.ack(1)
    acker.ack(3)
    await settle()
    assert channel.frames == [("nack", 2, False), ("ack", 3, True)]


async def test_a_tag_not_yet_received_is_never_covered() -> None:
    acker, channel, _ = await make(1, 3)  # 2 was sent by the broker but not handed over yet
    acker.ack(1)
    acker.ack(3)
    await settle()
    assert channel.frames == [("ack", 1, True)]
    await asyncio.sleep(0.1)
    assert ("ack", 3, True) not in channel.frames
    assert channel.frames[-1] == ("ack", 3, False)


async def test_a_closed_channel_refuses_and_counts_what_was_lost() -> None:
    acker, channel, lost = await make(1, 2)
    acker.ack(1)
    channel.is_closed = True
    await settle()
    assert channel.frames == []
    assert lost == [1]
    with pytest.raises(ChannelGone):
        acker.ack(2)
    with pytest.raises(ChannelGone):
        await acker.nack(2, requeue=True)


async def test_drain_sends_everything_done() -> None:
    acker, channel, _ = await make(1, 2, 3)
    acker.ack(3)
    await acker.send_all()
    assert channel.frames == [("ack", 3, False)]


async def test_frames_leave_in_the_order_they_were_decided_even_when_writing_waits() -> None:
    # A multiple ack overtaking a single ack below it is "unknown delivery tag" to the broker.
    acker, channel, _ = await make(1, 2, 3, 4, 5, max_delay=0.01)
    channel.slow = True
    acker.ack(2)
    acker.ack(3)
    await asyncio.sleep(0.05)  # 2 and 3 wait behind 1 long enough to be acked alone
    acker.ack(1)
    await acker.nack(4, requeue=True)
    acker.ack(5)
    await acker.send_all()
    assert broker_view(channel.frames, {1, 2, 3, 4, 5}) == {"acked": {1, 2, 3, 5}, "requeued": {4}}


def broker_view(frames: list[tuple[str, int, bool]], delivered: set[int]) -> dict[str, set[int]]:
    """What the broker makes of the frames, in order; an unknown tag closes the channel."""
    outstanding = set(delivered)
    settled: dict[str, set[int]] = {"acked": set(), "requeued": set()}
    for kind, tag, multiple in frames:
        if tag not in outstanding:
            raise AssertionError(f"PRECONDITION_FAILED - unknown delivery tag {tag}: {frames}")
        covered = {t for t in outstanding if t <= tag} if multiple else {tag}
        outstanding -= covered
        settled["acked" if kind == "ack" else "requeued"] |= covered
    return settled


async def test_a_frame_that_cannot_be_written_fails_its_waiter() -> None:
    acker, channel, _ = await make(1, 2)

    async def broken(*_: object, **__: object) -> None:
        raise ConnectionResetError("gone")

    channel.basic_nack = broken  # type: ignore[method-assign]
    with pytest.raises(ChannelGone):
        await acker.nack(1, requeue=True)


async def test_a_lost_multiple_ack_counts_every_delivery_it_covered() -> None:
    acker, channel, lost = await make(1, 2, 3, 4)

    async def broken(*_: object, **__: object) -> None:
        raise ConnectionResetError("gone")

    channel.basic_ack = broken  # type: ignore[method-assign]
    for tag in (1, 2, 3, 4):
        acker.ack(tag)
    await settle()
    assert lost == [4]


async def test_unsettled_counts_what_was_received_and_not_yet_acked_or_nacked() -> None:
    acker, _, _ = await make(1, 2, 3, 4, 5)
    assert acker.unsettled == 5
    acker.ack(2)
    await acker.nack(4, requeue=True)
    assert acker.unsettled == 3
    acker.ack(1)
    await settle()
    assert acker.unsettled == 2
    acker.ack(3)
    acker.ack(5)
    await acker.send_all()
    assert acker.unsettled == 0


async def test_settling_a_delivery_twice_is_counted_and_never_sent() -> None:
    channel = RecordingChannel()
    twice: list[None] = []
    acker = Acker(channel, on_settled_twice=lambda: twice.append(None))
    for tag in (1, 2, 3):
        acker.received(tag)
    acker.ack(1)
    acker.ack(1)
    await acker.nack(2, requeue=True)
    await acker.nack(2, requeue=False)
    await settle()
    acker.ack(1)  # already covered by a multiple ack
    acker.ack(3)
    await acker.send_all()
    assert len(twice) == 3
    assert broker_view(channel.frames, {1, 2, 3}) == {"acked": {1, 3}, "requeued": {2}}
