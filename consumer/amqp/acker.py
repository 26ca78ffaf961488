"""Acks and nacks for one channel, with acks coalesced into ``multiple=true`` where that is safe.

Delivery tags on a channel only grow. A single ``basic.ack(tag, multiple=true)`` acks every
outstanding delivery up to ``tag``, so it is sent only when every delivery up to it has committed
(or was already settled on its own). A delivery that is still being applied blocks the multiple ack
past it; deliveries done behind it are acked one by one once they have waited ``max_delay``, so a
slow event never holds the prefetch window hostage, or at once when they hold a quarter of the
``window`` (the prefetch): the broker sends nothing in their place until they are acked, and at a
small prefetch a few such deliveries are most of what it may send. Nacks are never coalesced:
``multiple=true`` would reject innocent deliveries too.
"""

from __future__ import annotations

import asyncio
import bisect
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import aiormq

from consumer.errors import ChannelGone

__all__ = ["Acker"]

_CHANNEL_ERRORS = (aiormq.exceptions.AMQPError, RuntimeError, ConnectionError)


class Acker:
    """Settles the deliveries of one channel. Create one per consume channel.

    Every ack and nack leaves through one writer, in the order it was decided: a multiple ack
    that overtook a single ack or nack of a tag below it would make the broker close the channel
    ("unknown delivery tag").
    """

    def __init__(
        self,
        channel: Any,
        *,
        max_delay: float = 0.05,
        window: int | None = None,
        on_lost: Callable[[int], None] | None = None,
        on_settled_twice: Callable[[], None] | None = None,
    ) -> None:
        self._channel = channel
        self._max_delay = max_delay
        self._scarce = max(1, window // 4) if window is not None else None
        self._on_lost = on_lost or (lambda _: None)
        self._on_settled_twice = on_settled_twice or (lambda: None)
        self._outstanding: deque[int] = deque()
        self._floor = 0  # every tag up to here is settled; tags start at 1 and have no gaps
        self._done: dict[int, float] = {}
        self._settled: set[int] = set()
        self._flush_scheduled = False
        self._timer: asyncio.TimerHandle | None = None
        self._frames: asyncio.Queue[_Frame] = asyncio.Queue()
        self._writer: asyncio.Task[None] | None = None

    @property
    def is_open(self) -> bool:
        return not self._channel.is_closed

    @property
    def unsettled(self) -> int:
        """Tags received and not yet acked or nacked."""
        return len(self._outstanding) - len(self._settled) - len(self._done)

    def _settled_already(self, tag: int) -> bool:
        """A second ack or nack of one tag would make the broker close the channel (unknown
        delivery tag): it is a bug of ours, counted and never sent."""
        if tag <= self._floor or tag in self._done or tag in self._settled:
            self._on_settled_twice()
            return True
        return False

    def received(self, tag: int) -> None:
        if self._outstanding and tag < self._outstanding[-1]:
            bisect.insort(self._outstanding, tag)  # not expected: deliveries arrive in order
        else:
            self._outstanding.append(tag)

    def ack(self, tag: int) -> None:
        """Mark ``tag`` committed; the ack goes out with the next flush (this loop iteration)."""
        if not self.is_open:
            raise ChannelGone(f"delivery tag {tag} belongs to a closed channel")
        if self._settled_already(tag):
            return
        self._done[tag] = time.monotonic()
        self._schedule_flush()

    async def nack(self, tag: int, *, requeue: bool) -> None:
        """Reject ``tag`` alone, now; returns once the frame is on its way."""
        if not self.is_open:
            raise ChannelGone(f"delivery tag {tag} belongs to a closed channel")
        if self._settled_already(tag):
            return
        self._settled.add(tag)
        sent = self._send(_Frame(tag, multiple=False, requeue=requeue))
        await sent
        self._schedule_flush()

    def _send(self, frame: _Frame) -> asyncio.Future[None]:
        frame.sent = asyncio.get_running_loop().create_future()
        self._frames.put_nowait(frame)
        if self._writer is None or self._writer.done():
            self._writer = asyncio.get_running_loop().create_task(self._write())
        return frame.sent

    async def _write(self) -> None:
        while not self._frames.empty():
            frame = self._frames.get_nowait()
            try:
                if frame.requeue is None:
                    await self._channel.basic_ack(frame.tag, multiple=frame.multiple, wait=False)
                else:
                    await self._channel.basic_nack(
                        frame.tag, multiple=False, requeue=frame.requeue, wait=False
                    )
            except Exception as error:  # a frame that cannot go out settles nothing
                self._fail_pending(frame, error)
                return
            if frame.sent is not None and not frame.sent.done():
                frame.sent.set_result(None)

    def _fail_pending(self, frame: _Frame, error: BaseException) -> None:
        lost = 0
        while True:
            if frame.requeue is None:
                lost += frame.covers
            if frame.sent is not None and not frame.sent.done():
                frame.sent.set_exception(ChannelGone(str(error)))
            if self._frames.empty():
                break
            frame = self._frames.get_nowait()
        if lost:
            self._on_lost(lost)

    def _schedule_flush(self) -> None:
        if not self._flush_scheduled:
            self._flush_scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    def _advance(self) -> tuple[int | None, int]:
        """Drop settled tags from the front; return the highest done tag a multiple ack may cover
        and how many done tags it acks.

        Only a gapless run from the last settled tag counts: a tag the broker sent but this
        object has not yet been told of must never be covered by a multiple ack.
        """
        highest: int | None = None
        covers = 0
        while self._outstanding and self._outstanding[0] == self._floor + 1:
            front = self._outstanding[0]
            if front in self._settled:
                self._settled.discard(front)
            elif front in self._done:
                del self._done[front]
                highest = front
                covers += 1
            else:
                break
            self._outstanding.popleft()
            self._floor = front
        return highest, covers

    def _flush(self) -> None:
        self._flush_scheduled = False
        if not self.is_open:
            lost = len(self._done)
            self._done.clear()
            if lost:
                self._on_lost(lost)
            return
        highest, covers = self._advance()
        if highest is not None:
            self._send(_Frame(highest, multiple=True, covers=covers))
        if self._done:
            # Done, but behind a delivery still being applied: ack alone once they have waited.
            cutoff = time.monotonic() - self._max_delay
            if self._scarce is not None and len(self._done) >= self._scarce:
                cutoff = float("inf")
            for tag, since in list(self._done.items()):
                if since <= cutoff:
                    del self._done[tag]
                    self._settled.add(tag)
                    self._send(_Frame(tag, multiple=False))
            if self._done and self._timer is None:
                self._timer = asyncio.get_running_loop().call_later(self._max_delay, self._tick)

    def _tick(self) -> None:
        self._timer = None
        self._flush()

    def close(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    async def send_all(self) -> None:
        """Send what is done and wait for it to be written (before closing the channel)."""
        if self._flush_scheduled or self._done:
            self._flush_scheduled = False
            if self._done:
                # Force out everything done, even what waits behind an unfinished delivery.
                for tag in list(self._done):
                    self._done[tag] = 0.0
            self._flush()
        if self._writer is not None:
            await asyncio.gather(self._writer, return_exceptions=True)


@dataclass(slots=True)
class _Frame:
    tag: int
    multiple: bool
    requeue: bool | None = None  # None: an ack
    sent: asyncio.Future[None] | None = None
    covers: int = 1
    """The deliveries it settles: a multiple ack settles every done tag up to ``tag``."""
