"""A queue read from its head with bounded memory, every message held until taken or given back.

AMQP 0-9-1 has no browse: a message read stays in the queue only while it is held unacked, and a
message given back (``nack(requeue)``) is at once ready to be read again. So a scan holds
everything it reads until it ends, then gives back what it did not take, in reading order. A scan
of the whole queue keeps its order. A partial one (``--limit``) may not: RabbitMQ 3.10 puts what
is given back behind the letters never read (measured here), so the letters read move to the back.

Holding is cheap for the client: the caller drops each body once read, and only the broker keeps
the messages (the client keeps the tags of those it took, a few bytes each). What bounds the
client's memory is the consumer's prefetch window: the broker sends at most ``window`` unsettled
messages to one consumer. When a consumer's window is full of held messages, a new one is
started on the same channel, with a window of its own (QoS is per consumer); the full ones get
nothing more while full. So at most one window of bodies is ever in the client, whatever
the queue's length.

Each message given back counts as a delivery (its ``x-delivery-count`` rises): the dead-letter
queue's delivery limit is set out of reach (topology/plan.py); other queues are scanned only a
bounded number of messages at a time (``consumer events show``).

A scan ends when it has read what the queue held when it began (its message count then, from a
passive declare), or when its channel closes. It never ends because nothing arrived for a moment
while the queue shows nothing ready: RabbitMQ counts a message out of "ready" as soon as it is
checked out to a consumer, and a quorum queue reads a consumer's whole window from disk before it
sends the first of it (measured on 3.10: 1.9 s for 40 letters of 32 MiB), so "nothing ready,
nothing here" is what a queue of large letters looks like just before they arrive. The one other
end is a stall: nothing at all arrived for ``stall`` seconds (5 minutes unless told), which only a
queue that lost messages under the scan (another client took or purged them) or a broker that
stopped sending gives. A scan that ended short says why (:attr:`QueueScan.shortfall`), and the
tools say so and exit non-zero. Only a queue whose messages expire by themselves (a retry rung,
``idle_end``) may end sooner, once nothing is ready and nothing came for a while.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Any

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aiormq.abc import ChannelFrame
from pamqp.commands import Basic

from consumer.amqp.ack_runs import AckRuns

__all__ = ["DEFAULT_STALL", "DEFAULT_WINDOW", "Delivered", "Held", "QueueScan"]

DEFAULT_WINDOW = 500
DEFAULT_STALL = 300.0
"""Seconds with nothing at all arriving after which a scan gives up (and says it is incomplete)."""
_NACKS_PER_WRITE = 32  # see _nack_each
_SETTLE_WAIT = 5.0


def _at_least(ready: int) -> Callable[[int, int], bool]:
    return lambda count, _: count >= ready


@dataclass(frozen=True, slots=True)
class Delivered:
    """A delivery's body, properties and routing key: all a dead letter is read from. Lighter
    than aio-pika's message, which copies every property into attributes of its own."""

    body: bytes
    properties: Basic.Properties
    routing_key: str | None

    @property
    def headers(self) -> dict[str, Any] | None:
        return self.properties.headers

    @property
    def content_type(self) -> str | None:
        return self.properties.content_type

    @property
    def content_encoding(self) -> str | None:
        return self.properties.content_encoding

    @property
    def message_id(self) -> str | None:
        return self.properties.message_id


@dataclass(frozen=True, slots=True)
class Held:
    """One message read and held unacked; ``take`` removes it from the queue."""

    message: Delivered
    tag: int
    consumer: str


class QueueScan:
    """One pass over the messages a queue held when the scan began (up to a limit).

    An async context manager: on exit every message read and not taken is given back, in reading
    order, and the channel is closed. If the process dies instead, the broker gives them back.
    """

    def __init__(
        self,
        connection: AbstractConnection,
        *,
        queue: str,
        window: int = DEFAULT_WINDOW,
        stall: float = DEFAULT_STALL,
        idle_end: float | None = None,
    ) -> None:
        """``stall``: seconds with nothing arriving before the scan gives up, incomplete.
        ``idle_end``: only for a queue whose messages expire by themselves (a retry rung): the
        scan also ends, not incomplete, once nothing is ready and nothing came for that long."""
        if window < 1:
            raise ValueError("a scan's window holds at least one message")
        if not stall > 0:
            raise ValueError("a scan waits more than 0 seconds for a message")
        self._connection = connection
        self._queue = queue
        self._window = window
        self._stall = stall
        self._idle_end = idle_end
        self._channel: AbstractChannel | None = None
        self._raw: Any = None
        self._closed_watch: asyncio.Future[Any] | None = None
        self._closed_by = ""
        # None: the channel closed (nothing more will come).
        self._arrived: asyncio.Queue[aiormq.abc.DeliveredMessage | None] = asyncio.Queue()
        self._consumer_tags: list[str] = []
        self._unsettled: dict[str, int] = {}
        self._runs = AckRuns()
        self._gave_up_waiting = False
        self._returned_up_to = 0
        self._last_tag = 0
        self.present = 0
        """How many messages were ready in the queue when the scan began."""
        self.read = 0
        """How many messages the scan has read so far."""
        self.shortfall: str | None = None
        """Why the scan ended before reading what it set out to (None: it did not)."""

    async def __aenter__(self) -> QueueScan:
        self._channel = await self._connection.channel(publisher_confirms=False)
        self._raw = await self._channel.get_underlay_channel()
        declared = await self._raw.queue_declare(self._queue, passive=True)
        # What is there now is what a scan sees: letters that keep arriving while it reads (a
        # crash loop dead-lettering away) must not keep it reading, and holding, for ever.
        self.present = int(declared.message_count or 0)
        await self._raw.basic_qos(prefetch_count=self._window)
        # A scan waiting for a delivery learns at once that none will come.
        self._closed_watch = self._raw.closing
        self._closed_watch.add_done_callback(self._channel_closed)
        return self

    @property
    def incomplete(self) -> bool:
        """Whether the scan ended before reading what it set out to."""
        return self.shortfall is not None

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        channel, self._channel = self._channel, None
        if channel is None or channel.is_closed:
            self._stop_watching()
            return
        with contextlib.suppress(aiormq.exceptions.AMQPError, ConnectionError, RuntimeError):
            await asyncio.shield(self._give_back())
        self._stop_watching()
        with contextlib.suppress(aiormq.exceptions.AMQPError, ConnectionError, RuntimeError):
            await channel.close()

    def _stop_watching(self) -> None:
        watch, self._closed_watch = self._closed_watch, None
        if watch is not None and not watch.done():
            watch.cancel()

    async def _give_back(self) -> None:
        await self._stop_consuming()
        # Deliveries that arrived after the last one read (the window's read-ahead) are held
        # too: give back everything up to the newest tag.
        while not self._arrived.empty():
            arrived = self._arrived.get_nowait()
            if arrived is not None:
                self._last_tag = max(self._last_tag, arrived.delivery_tag or 0)
        first, last = self._returned_up_to + 1, self._last_tag
        self._returned_up_to = last
        if last < first:
            return
        # One nack each, in tag order, which is reading order: a quorum queue puts what is given
        # back at its head in the order it comes back. (A multiple nack would be one frame, but
        # the broker returns its messages in no particular order.) The channel's delivery tags
        # are 1, 2, 3... and every delivery on it is this scan's.
        ready = await self._ready()
        await self._nack_each(
            (t for t in range(first, last + 1) if not self._runs.acked(t)), ready=ready
        )

    async def _stop_consuming(self) -> None:
        """Cancel every consumer. Deliveries still arriving are caught (the client would drop
        them, held, until the channel closes) and given back with the rest."""
        for tag in self._consumer_tags:
            await self._raw.basic_cancel(tag)
            self._raw.consumers[tag] = self._arrive
        self._consumer_tags = []

    async def _ready(self) -> int:
        declared = await self._raw.queue_declare(self._queue, passive=True)
        return int(declared.message_count or 0)

    async def _until(self, done: Callable[[int, int], bool]) -> None:
        """Until ``done(ready, consumers)`` holds for the queue: a quorum queue applies nacks
        after the channel sent them, and a command run right after this one (the next ``dlq
        list``) would otherwise see part of the queue, in another order. Bounded, and given up
        for the rest of the scan once the bound is hit: another client consuming, or a rung's
        messages expiring, can keep the count below for ever (then only the order may suffer)."""
        if self._gave_up_waiting:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _SETTLE_WAIT
        while loop.time() < deadline:
            declared = await self._raw.queue_declare(self._queue, passive=True)
            if done(int(declared.message_count or 0), int(declared.consumer_count or 0)):
                return
            await asyncio.sleep(0.01)
        self._gave_up_waiting = True

    async def _nack_each(self, tags: Iterator[int], *, ready: int) -> None:
        """Single nacks, 32 to a write, each write applied (the queue's ready count has grown
        by as many) before the next: the broker gathers the nacks it has at hand in a map, which
        keeps their order only up to 32 keys (measured: larger batches came back shuffled). Through
        the channel's own write queue, so they go out in order with everything else on it."""
        while chunk := list(itertools.islice(tags, _NACKS_PER_WRITE)):
            await self._write(
                [Basic.Nack(delivery_tag=tag, multiple=False, requeue=True) for tag in chunk]
            )
            ready += len(chunk)
            await self._until(_at_least(ready))

    async def messages(self, limit: int | None = None) -> AsyncIterator[Held]:
        """The messages the queue held when the scan began (at most ``limit``), in queue order,
        each held until :meth:`take` or the scan's end. Ending short of them sets
        :attr:`shortfall`."""
        bound = self.present if limit is None else min(limit, self.present)
        while self.read < bound:
            if not self._consumer_tags or self._unsettled[self._consumer_tags[-1]] >= self._window:
                await self._next_consumer()
            delivered = await self._next()
            if delivered is None:
                return
            self.read += 1
            tag = int(delivered.delivery_tag or 0)
            self._last_tag = max(self._last_tag, tag)
            consumer = delivered.consumer_tag or ""
            self._unsettled[consumer] = self._unsettled.get(consumer, 0) + 1
            message = Delivered(delivered.body, delivered.header.properties, delivered.routing_key)
            yield Held(message, tag, consumer)

    async def purge_ready(self) -> int:
        """Delete every message ready in the queue (none this scan holds); returns how many."""
        result = await self._raw.queue_purge(self._queue)
        return int(result.message_count or 0)

    async def take(self, held: Held) -> None:
        """Remove a held message from the queue (ack it)."""
        await self.take_all([held])

    async def take_all(self, held: Sequence[Held]) -> None:
        """Remove held messages from the queue, and only them: one write, a run from the oldest
        message not yet removed acked as one (``multiple``), the others each alone."""
        if not held:
            return
        plan = self._runs.plan(message.tag for message in held)
        frames = [Basic.Ack(delivery_tag=tag, multiple=False) for tag in plan.singles]
        if plan.up_to is not None:
            frames.insert(0, Basic.Ack(delivery_tag=plan.up_to, multiple=True))
        # Counted as taken (planned) before the write: whether the broker got it or not, a tag
        # planned is never given back by this scan (a nack of an acked tag would close the
        # channel). The plan is the one record of what was taken: a set of every tag would grow
        # with the letters replayed (issue 31).
        for message in held:
            self._unsettled[message.consumer] -= 1
        await self._write(frames)

    async def _write(self, frames: Sequence[Basic.Ack | Basic.Nack]) -> None:
        """``frames`` in one write, through the channel's own write queue (in order with
        everything else on it); :class:`ConnectionError` if the channel closes first."""
        if self._raw.is_closed:
            raise ConnectionError(f"the channel reading {self._queue} closed")
        # The channel's own future: failed, not left pending, if the channel closes first (aiormq
        # drops the frames still queued when a connection closes, and never resolves theirs).
        written = self._raw.create_future()
        await self._raw.write_queue.put(
            ChannelFrame.marshall(
                channel_number=self._raw.number, frames=list(frames), drain_future=written
            )
        )
        try:
            await written
        except asyncio.CancelledError as error:
            if written.cancelled():  # this task was cancelled (Ctrl-C): not the channel's doing
                raise
            # aiormq fails a channel's futures with the CancelledError that stopped its reader (a
            # broker silent past the heartbeat): the channel closed, and this task goes on.
            raise ConnectionError(f"the channel reading {self._queue} closed") from error
        except (aiormq.exceptions.AMQPError, ConnectionError):
            raise
        except Exception as error:  # what closed the channel, or a bare Exception on a clean close
            raise ConnectionError(f"the channel reading {self._queue} closed") from error

    async def _next_consumer(self) -> None:
        # The newest consumer's window is full of held messages. It is not cancelled: a
        # quorum queue applies a cancel late, and could meanwhile deliver to it (a slot freed by
        # a take) what the client would then drop. It simply gets nothing more while full.
        if self._raw.is_closed:
            return  # the next read finds the channel closed, and ends the scan saying so
        try:
            consumed = await self._raw.basic_consume(self._queue, self._arrive, no_ack=False)
        except (aiormq.exceptions.AMQPError, ConnectionError):
            if self._raw.is_closed:
                return
            raise
        self._consumer_tags.append(consumed.consumer_tag)
        self._unsettled.setdefault(consumed.consumer_tag, 0)

    async def _arrive(self, message: aiormq.abc.DeliveredMessage) -> None:
        self._arrived.put_nowait(message)

    async def _next(self) -> aiormq.abc.DeliveredMessage | None:
        """The next delivery; ``None`` once none will come: the channel closed, or nothing came
        for ``stall`` seconds (both set :attr:`shortfall`), or a queue that expires its messages
        has none left to send (``idle_end``)."""
        if not self._arrived.empty():  # the common case, without a timer
            return self._unless_closed(self._arrived.get_nowait())
        loop = asyncio.get_running_loop()
        stalled_at = loop.time() + self._stall
        while True:
            wait = stalled_at - loop.time()
            if self._idle_end is not None:
                wait = min(wait, self._idle_end)
            try:
                # Not wait_for: on Python 3.11 it returns a delivery that arrives as the task is
                # cancelled and drops the cancel (Ctrl-C would then be lost).
                async with asyncio.timeout(max(wait, 0.0)):
                    return self._unless_closed(await self._arrived.get())
            except TimeoutError:
                pass
            if loop.time() >= stalled_at:
                self.shortfall = f"nothing arrived for {self._stall:g}s"
                return None
            if self._raw.is_closed or not self._arrived.empty():
                continue  # what came meanwhile (or the channel's close) is read at once
            if not await self._ready() and self._arrived.empty():
                return None  # idle_end: what was not read has expired meanwhile

    def _unless_closed(
        self, arrived: aiormq.abc.DeliveredMessage | None
    ) -> aiormq.abc.DeliveredMessage | None:
        if arrived is None:
            self._arrived.put_nowait(None)  # for the next call: the channel stays closed
            why = f": {self._closed_by}" if self._closed_by else ""
            self.shortfall = f"the channel reading {self._queue} closed{why}"
        return arrived

    def _channel_closed(self, closing: asyncio.Future[Any]) -> None:
        if not closing.cancelled() and closing.exception() is not None:
            error = closing.exception()
            self._closed_by = str(error) or type(error).__name__
        self._arrived.put_nowait(None)
