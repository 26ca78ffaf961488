"""Replay's removals: gathered into few writes, and counted only once written, so the tally is
exact whether the write went out or the channel had closed. And the scan's writes (removals and
give-backs) end when their channel closes, however aiormq closes it."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

import pytest
from aiormq.base import FutureStore
from pamqp.commands import Basic

from consumer.cli.dlq.replay import ReplayOptions, Tally, _one, _Removal, replay
from consumer.cli.dlq.stream import Delivered, Held, QueueScan
from consumer.errors import Unroutable


class Scan:
    """Records each ``take_all``; fails them all once ``closed``."""

    def __init__(self, *, closed: bool = False) -> None:
        self.writes: list[list[int]] = []
        self.closed = closed

    async def take_all(self, held: Sequence[Held]) -> None:
        if self.closed:
            raise ConnectionError("the channel reading x.dead closed")
        self.writes.append([message.tag for message in held])


def held(tag: int) -> Held:
    return Held(cast(Any, None), tag, "consumer-1")


async def remove(scan: Scan, tags: list[int]) -> tuple[Tally, list[Any]]:
    tally = Tally()
    said: list[Any] = []
    removal = _Removal(cast(QueueScan, scan), tally, lambda letter, why: said.append((letter, why)))
    running = asyncio.create_task(removal.run())
    for tag in tags:
        removal.confirmed(held(tag), cast(Any, f"letter {tag}"))
        await asyncio.sleep(0)
    removal.close()
    await running
    return tally, said


async def test_confirmed_letters_are_removed_together_and_counted_once_written() -> None:
    scan = Scan()

    tally, said = await remove(scan, [1, 2, 3, 5])

    # One write for letters confirmed close together, each said replayed
    assert scan.writes == [[1, 2, 3, 5]]
    assert tally.replayed == 4
    assert tally.not_removed == 0
    assert said == [(f"letter {tag}", None) for tag in (1, 2, 3, 5)]


async def test_a_removal_that_cannot_be_written_is_counted_not_removed() -> None:
    scan = Scan(closed=True)

    tally, said = await remove(scan, [1, 2])

    assert tally.replayed == 0
    assert tally.not_removed == 2
    assert [why for _, why in said] == [
        "replayed, but its dead copy could not be removed: it is there too"
    ] * 2


async def test_closing_with_nothing_confirmed_returns_at_once() -> None:
    scan = Scan()

    tally, _ = await remove(scan, [])

    assert scan.writes == []
    assert tally.replayed == 0


class ChannelOfAiormq:
    """The parts of aiormq's channel ``take_all`` writes through; its futures kept by aiormq's
    own store, which its connection rejects when it closes."""

    def __init__(self) -> None:
        self.futures = FutureStore(asyncio.get_running_loop())
        self.write_queue: asyncio.Queue[object] = asyncio.Queue()
        self.number = 1
        self.is_closed = False

    def create_future(self) -> asyncio.Future[None]:
        return self.futures.create_future()


def scan_on(channel: ChannelOfAiormq, tags: list[int]) -> tuple[QueueScan, list[Held]]:
    scan = QueueScan(cast(Any, None), queue="x.dead")
    scan._raw = channel
    scan._unsettled["consumer-1"] = len(tags)
    return scan, [held(tag) for tag in tags]


async def test_a_removal_cut_off_by_a_silent_broker_is_a_closed_channel_not_a_cancel() -> None:
    # Given a removal written and waiting for its frame to go out
    channel = ChannelOfAiormq()
    scan, letters = scan_on(channel, [1, 2])
    taking = asyncio.create_task(scan.take_all(letters))
    await asyncio.sleep(0)

    # When the connection closes as aiormq closes it once the heartbeat ran out: its reader was
    # cancelled, and every pending future is failed with that CancelledError
    await channel.futures.reject_all(asyncio.CancelledError())

    # Then the removal failed as on any closed channel, and the task taking it was not cancelled
    with pytest.raises(ConnectionError, match="closed"):
        await taking
    assert not taking.cancelled()


async def test_a_replay_cut_off_by_a_silent_broker_counts_every_confirmed_letter() -> None:
    # Given confirmed letters whose removal the broker's silence cuts off
    channel = ChannelOfAiormq()
    scan, _ = scan_on(channel, [1, 2, 3])
    tally = Tally()
    said: list[Any] = []
    removal = _Removal(scan, tally, lambda letter, why: said.append((letter, why)))
    running = asyncio.create_task(removal.run())
    removal.confirmed(held(1), cast(Any, "letter 1"))
    while channel.write_queue.empty():
        await asyncio.sleep(0.005)
    await channel.futures.reject_all(asyncio.CancelledError())
    channel.is_closed = True

    # When more letters are confirmed afterwards, and the replay ends
    removal.confirmed(held(2), cast(Any, "letter 2"))
    removal.confirmed(held(3), cast(Any, "letter 3"))
    removal.close()
    await asyncio.wait_for(asyncio.shield(running), 5)

    # Then each is counted: replayed but still a dead letter too, none left out of the tally
    assert tally.replayed == 0
    assert tally.not_removed == 3
    assert [letter for letter, _ in said] == ["letter 1", "letter 2", "letter 3"]


async def test_a_removal_whose_own_task_is_cancelled_is_still_cancelled() -> None:
    # Given a removal waiting for its frame to go out
    channel = ChannelOfAiormq()
    scan, letters = scan_on(channel, [1])
    taking = asyncio.create_task(scan.take_all(letters))
    await asyncio.sleep(0)

    # When its own task is cancelled (Ctrl-C on a purge)
    taking.cancel()

    # Then it ends cancelled, as before
    with pytest.raises(asyncio.CancelledError):
        await taking


async def test_giving_back_on_a_connection_that_closes_ends_instead_of_waiting_for_ever() -> None:
    # Given a scan giving its letters back, the nacks queued for the connection's writer
    channel = ChannelOfAiormq()
    scan, _ = scan_on(channel, [1, 2])
    giving_back = asyncio.create_task(scan._nack_each(iter([1, 2]), ready=0))
    while channel.write_queue.empty():
        await asyncio.sleep(0)

    # When the connection closes before writing them (aiormq drops what is still queued)
    await channel.futures.reject_all(ConnectionError("Connection reset by peer"))

    # Then giving back fails as on any closed channel (the broker has the letters back), and the
    # command ends instead of holding its summary's exit for ever
    with pytest.raises(ConnectionError):
        await asyncio.wait_for(giving_back, 5)


async def test_a_report_that_cannot_be_printed_stops_no_removal() -> None:
    # Given a replay whose output goes to a pager the operator quits after the first line
    scan = Scan()
    tally = Tally()
    said: list[Any] = []

    def report(letter: Any, _: str | None) -> None:
        said.append(letter)
        if len(said) == 1:
            raise BrokenPipeError(32, "Broken pipe")

    removal = _Removal(cast(QueueScan, scan), tally, report)
    running = asyncio.create_task(removal.run())

    # When letters go on being confirmed after the first report failed
    removal.confirmed(held(1), cast(Any, "letter 1"))
    while not scan.writes:
        await asyncio.sleep(0.005)
    removal.confirmed(held(2), cast(Any, "letter 2"))
    removal.confirmed(held(3), cast(Any, "letter 3"))
    removal.close()

    # Then each is removed and counted (none left in both queues), and the failure is raised
    # once they are
    with pytest.raises(BrokenPipeError):
        await asyncio.wait_for(running, 5)
    assert scan.writes == [[1], [2, 3]]
    assert tally.replayed == 3


async def test_a_failed_letter_whose_report_cannot_be_printed_fails_the_replay_at_its_end() -> None:
    # Given a replay whose output goes to a pager the operator has quit, and a letter whose
    # copy the broker returns
    tally = Tally()

    def report(letter: Any, _: str | None) -> None:
        raise BrokenPipeError(32, "Broken pipe")

    class Returning:
        async def send(self, *_: Any, **__: Any) -> None:
            raise Unroutable("'x.events' could not route 't'")

    removal = _Removal(cast(QueueScan, Scan()), tally, report)
    running = asyncio.create_task(removal.run())
    letter = SimpleNamespace(headers={}, body=b"{}", expired=False, type="t")
    window = asyncio.Semaphore(0)

    # When its task settles it
    await _one(
        Held(Delivered(b"{}", Basic.Properties(), "t"), 1, "consumer-1"),
        cast(Any, letter),
        cast(Any, Returning()),
        ReplayOptions(exchange="x.events"),
        tally,
        window,
        removal,
    )
    removal.close()

    # Then it is counted failed, and the report's failure is not lost with the task: the replay
    # raises it once every letter is settled
    assert sum(tally.failed.values()) == 1
    with pytest.raises(BrokenPipeError):
        await asyncio.wait_for(running, 5)


class ScanThatSwallowsACancel:
    """Reads 1,000 letters (about 5s); an await in it returns its letter even when the task is
    cancelled meanwhile, as ``asyncio.wait_for`` does on Python 3.11 when the two meet."""

    def __init__(self) -> None:
        self.read = 0

    async def messages(self) -> Any:
        while self.read < 1_000:
            self.read += 1
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.sleep(0.005)
            yield Held(Delivered(b"{}", Basic.Properties(), "t"), self.read, "consumer-1")

    async def take_all(self, held: Sequence[Held]) -> None:
        return None


async def test_ctrl_c_stops_a_replay_even_when_an_await_swallowed_it() -> None:
    # Given a replay under way over letters none of which is selected
    scan = ScanThatSwallowsACancel()
    unselected = SimpleNamespace(matches=lambda letter: False)
    running = asyncio.create_task(
        replay(
            cast(QueueScan, scan),
            lambda held: cast(Any, SimpleNamespace()),
            cast(Any, unselected),
            cast(Any, None),
            ReplayOptions(exchange="x.events"),
            Tally(),
            lambda letter, why: None,
        )
    )
    while scan.read < 3:
        await asyncio.sleep(0.005)

    # When the operator presses Ctrl-C (the command's task is cancelled) and the await that
    # meets the cancel swallows it
    running.cancel()

    # Then the replay stops, cancelled, instead of going on (and ending with exit 0)
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(asyncio.shield(running), 2)
    assert running.cancelled()
