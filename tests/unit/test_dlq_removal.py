"""Replay's removals: gathered into few writes, and counted only once written, so the tally is
exact whether the write went out or the channel had closed."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any, cast

from consumer.dlq_replay import Tally, _Removal
from consumer.dlq_stream import Held, QueueScan


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
