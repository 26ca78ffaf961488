"""A publish whose confirm a closing connection cuts off fails as a publish, never as a cancel."""

from __future__ import annotations

import asyncio
from datetime import timedelta
from typing import Any

import pytest
from aiormq.base import FutureStore
from pamqp.commands import Basic

from consumer.amqp.publisher import Publisher
from consumer.errors import PublishFailed


class ChannelOfAiormq:
    """A confirm-mode channel whose confirms wait in aiormq's own future store, which its
    connection rejects when it closes."""

    def __init__(self) -> None:
        self.futures = FutureStore(asyncio.get_running_loop())
        self.is_closed = False

    async def basic_publish(self, body: bytes, **_: Any) -> Any:
        return await self.futures.create_future()


async def publishing(channel: ChannelOfAiormq) -> asyncio.Task[None]:
    publisher = Publisher(channel, timeout=timedelta(seconds=30))
    sending = asyncio.create_task(
        publisher.publish(b"{}", Basic.Properties(), exchange="x", routing_key="a.b")
    )
    while not channel.futures.futures:
        await asyncio.sleep(0)
    return sending


async def test_a_confirm_cut_off_by_a_silent_broker_is_a_failed_publish() -> None:
    # Given a publish waiting for its confirm
    channel = ChannelOfAiormq()
    sending = await publishing(channel)

    # When the connection closes as aiormq closes it once the heartbeat ran out: every pending
    # future fails with the CancelledError that stopped its reader
    await channel.futures.reject_all(asyncio.CancelledError())

    # Then the publish failed (the caller returns the original), and its task was not cancelled
    with pytest.raises(PublishFailed, match="closed"):
        await sending
    assert not sending.cancelled()


async def test_a_publish_whose_own_task_is_cancelled_is_still_cancelled() -> None:
    # Given a publish waiting for its confirm
    sending = await publishing(ChannelOfAiormq())

    # When its own task is cancelled (Ctrl-C on a command)
    sending.cancel()

    # Then it ends cancelled, as before
    with pytest.raises(asyncio.CancelledError):
        await sending


async def test_a_confirm_rejected_with_a_bare_exception_is_a_failed_publish() -> None:
    # Given a publish waiting for its confirm
    channel = ChannelOfAiormq()
    sending = await publishing(channel)

    # When the connection closes as aiormq closes one whose reader ended without an error: every
    # pending future fails with a bare Exception
    await channel.futures.reject_all(None)

    # Then the publish failed (the caller returns the original), not an unexpected error
    with pytest.raises(PublishFailed, match="closed"):
        await sending
