"""Sending dead letters back: pipelined confirms, paced, and a tally that outlives a failure.

Each letter is published with its event type as the routing key and its attempts reset; its dead
copy is acked only once the broker confirmed the new one. Up to ``in_flight`` publishes wait for
their confirms at once (one round trip per window, not per letter); the dead copies of the
letters confirmed meanwhile are removed together, one write for dozens (a run of them from the
oldest still held is one ``multiple`` ack: :mod:`consumer.amqp.ack_runs`), and a letter kept or
failed in between stays held, never covered by one. Whatever stops a replay half-way (Ctrl-C, the
broker gone, the exchange deleted), every letter is either replayed and removed, or still in the
dead-letter queue; a letter whose copy was published but not confirmed may be in both (at least
once), and the receipts make the second copy harmless: applied once. A letter is counted
replayed once its removal is written, so the tally is exact whenever the replay stops.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime

import aiormq

from consumer.amqp import headers as h
from consumer.amqp.publisher import copy_properties
from consumer.cli.dlq.letters import DeadMessage, Selection, renewed
from consumer.cli.dlq.replay_sender import ReplaySender
from consumer.cli.dlq.stream import Held, QueueScan
from consumer.errors import PublishFailed, Unroutable

__all__ = ["DEFAULT_IN_FLIGHT", "NO_ENVELOPE", "Pacer", "ReplayOptions", "Tally", "replay"]

DEFAULT_IN_FLIGHT = 256
NO_ENVELOPE = "not a valid envelope: there is no event to replay"
_CHANNEL_CLOSED = "not tried: the publishing channel had closed"
_GATHER = 0.02  # seconds a confirmed letter may wait for others to be removed with

Reader = Callable[[Held], DeadMessage]
Report = Callable[[DeadMessage, str | None], None]
"""Told of each settled letter: ``None`` when replayed, else why it stays."""


@dataclass(frozen=True, slots=True)
class ReplayOptions:
    exchange: str
    force: bool = False
    limit: int | None = None
    rate: float | None = None
    in_flight: int = DEFAULT_IN_FLIGHT


@dataclass(slots=True)
class Tally:
    """What a replay did so far; complete at any moment, so a summary can be printed whenever
    the replay stops."""

    read: int = 0
    selected: int = 0
    replayed: int = 0
    kept: Counter[str] = field(default_factory=Counter)
    failed: Counter[str] = field(default_factory=Counter)
    not_removed: int = 0
    """Confirmed copies whose dead copy could not be acked: the letter is back in the queue too."""

    def lines(self) -> list[str]:
        out = [
            f"replayed {self.replayed} of {self.selected} selected ({self.read} read); "
            f"{sum(self.kept.values())} kept, {sum(self.failed.values())} failed: those stay in "
            "the dead-letter queue"
        ]
        out += [f"  kept {count}: {why}" for why, count in self.kept.most_common()]
        out += [f"  failed {count}: {why}" for why, count in self.failed.most_common()]
        if self.not_removed:
            out.append(
                f"  {self.not_removed} replayed but still in the dead-letter queue too (the "
                "connection closed before their removal): a second replay is harmless, the "
                "receipts apply each event once"
            )
        return out


class Pacer:
    """At most ``rate`` starts a second, evenly spaced; no limit when ``rate`` is None."""

    def __init__(self, rate: float | None, start: float) -> None:
        if rate is not None and rate <= 0:
            raise ValueError("a rate is above 0")
        self._interval = 1 / rate if rate else 0.0
        self._next = start

    def delay(self, now: float) -> float:
        """How long to wait before the next start; books that start."""
        if not self._interval:
            return 0.0
        # A late start does not earn a burst: the schedule never runs behind by more than now.
        self._next = max(self._next, now)
        wait = self._next - now
        self._next += self._interval
        return wait


async def replay(
    scan: QueueScan,
    read: Reader,
    selection: Selection,
    sender: ReplaySender,
    options: ReplayOptions,
    tally: Tally,
    report: Report,
    progress: Callable[[], None] = lambda: None,
) -> None:
    """Replay the selected letters of ``scan`` (at most ``options.limit``), counting into
    ``tally``. Cancelled, it waits for the publishes in flight, so their letters are settled."""
    window = asyncio.Semaphore(options.in_flight)
    pending: set[asyncio.Task[None]] = set()
    loop = asyncio.get_running_loop()
    pacer = Pacer(options.rate, loop.time())
    removal = _Removal(scan, tally, report)
    remover = asyncio.create_task(removal.run())
    try:
        async for held in scan.messages():
            _stop_if_cancelled()
            tally.read += 1
            progress()
            letter = read(held)
            if not selection.matches(letter):
                continue
            if options.limit is not None and tally.selected >= options.limit:
                break
            tally.selected += 1
            refusal = _refusal(letter, force=options.force)
            if refusal is None and not sender.is_open:
                refusal = _CHANNEL_CLOSED
            if refusal is not None:
                tally.kept[refusal] += 1
                report(letter, refusal)
                if refusal == _CHANNEL_CLOSED:
                    break
                continue
            delay = pacer.delay(loop.time())
            # Unpaced, no yield per letter: the publishes asked for until the loop comes round
            # go out in one write (consumer.cli.dlq.replay_sender).
            if delay:
                await asyncio.sleep(delay)
            await window.acquire()
            task = asyncio.create_task(_one(held, letter, sender, options, tally, window, removal))
            pending.add(task)
            task.add_done_callback(pending.discard)
    finally:
        # Stopped or not, the copies on their way are confirmed (or fail) and their letters
        # settled before the scan gives the rest back.
        while pending:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(asyncio.gather(*pending, return_exceptions=True))
        removal.close()
        while not remover.done():
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.wait([remover])
        remover.result()  # what failed in it (a report that could not be printed) fails the replay
        _stop_if_cancelled()


def _stop_if_cancelled() -> None:
    """Raise the cancel (Ctrl-C) asked of this task if an await swallowed it: a replay that goes
    on after Ctrl-C, or ends with exit 0, would tell the operator the wrong story."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class _Removal:
    """Removes the dead copies of confirmed letters, as many as have gathered in one write (a
    write a letter, awaited in turn, cost more than the publish). A letter is counted replayed
    only once its ack is written, so the tally is exact whenever the replay stops."""

    def __init__(self, scan: QueueScan, tally: Tally, report: Report) -> None:
        self._scan = scan
        self._tally = tally
        self._report = report
        self._confirmed: list[tuple[Held, DeadMessage]] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._report_failed: Exception | None = None

    def confirmed(self, held: Held, letter: DeadMessage) -> None:
        """Its new copy is confirmed: its dead copy goes with the next write."""
        self._confirmed.append((held, letter))
        self._wake.set()

    def close(self) -> None:
        """No more letters: :meth:`run` removes those gathered, then returns."""
        self._closing = True
        self._wake.set()

    async def run(self) -> None:
        while not (self._closing and not self._confirmed):
            await self._wake.wait()
            if not self._closing:
                # Confirms come back a few at a time: waiting a little lets one write remove
                # dozens (a run of them one ``multiple`` ack, which the broker also settles once).
                await asyncio.sleep(_GATHER)
            self._wake.clear()
            batch, self._confirmed = self._confirmed, []
            if batch:
                await self._remove(batch)
        if self._report_failed is not None:
            raise self._report_failed

    async def _remove(self, batch: list[tuple[Held, DeadMessage]]) -> None:
        try:
            await self._scan.take_all([held for held, _ in batch])
        except (aiormq.exceptions.AMQPError, ConnectionError, RuntimeError):
            self._tally.not_removed += len(batch)
            for _, letter in batch:
                self.tell(
                    letter, "replayed, but its dead copy could not be removed: it is there too"
                )
            return
        self._tally.replayed += len(batch)
        for _, letter in batch:
            self.tell(letter, None)

    def tell(self, letter: DeadMessage, problem: str | None) -> None:
        """Report a settled letter; a failure to is raised by :meth:`run`, at its end."""
        # Letters go on being removed and counted though reporting them fails (the operator quit
        # the pager the output went to): only lines are lost, as when each letter was removed by
        # a task of its own; the first failure is raised once every letter is removed. Letters
        # that failed are told here too: a report raising in their task would be lost with it.
        try:
            self._report(letter, problem)
        except Exception as error:
            if self._report_failed is None:
                self._report_failed = error


def _refusal(letter: DeadMessage, *, force: bool) -> str | None:
    if letter.type is None:
        return NO_ENVELOPE
    return letter.refusal(force=force)


async def _one(
    held: Held,
    letter: DeadMessage,
    sender: ReplaySender,
    options: ReplayOptions,
    tally: Tally,
    window: asyncio.Semaphore,
    removal: _Removal,
) -> None:
    try:
        headers = h.replay_headers(letter.headers)
        body = letter.body
        if letter.expired:
            body, headers[h.ORIGINAL_OCCURRED_AT] = renewed(body, datetime.now(UTC))
        properties = copy_properties(held.message.properties, headers=headers)
        # The validated event type, never a routing key a header claims: a producer could
        # otherwise have the replay delivered wherever it likes. The publish is one call, so a
        # header that travels with it (a trace context) is added in one place.
        assert letter.type is not None
        await sender.send(body, properties, exchange=options.exchange, routing_key=letter.type)
    except Unroutable as error:
        tally.failed[f"unroutable: {error}"] += 1
        removal.tell(letter, str(error))
        return
    except PublishFailed as error:
        tally.failed[str(error)[:200]] += 1
        removal.tell(letter, str(error))
        return
    finally:
        window.release()
    removal.confirmed(held, letter)
