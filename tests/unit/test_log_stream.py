"""Log lines leave once per turn of the event loop, in order, and none is left behind."""

from __future__ import annotations

import asyncio
import io

from consumer.logs import TickFlushed


class _Recording(io.BytesIO):
    def __init__(self) -> None:
        super().__init__()
        self.writes = 0

    def write(self, data: bytes) -> int:  # type: ignore[override]
        self.writes += 1
        return super().write(data)


async def test_lines_of_one_turn_go_out_in_one_write_at_its_end() -> None:
    sink = _Recording()
    stream = TickFlushed(sink)
    for n in range(100):
        stream.write(b"line %d\n" % n)
        stream.flush()
    assert sink.getvalue() == b""  # still this turn
    await asyncio.sleep(0)
    assert sink.getvalue() == b"".join(b"line %d\n" % n for n in range(100))
    assert sink.writes == 1


async def test_a_full_buffer_goes_out_before_the_turn_ends() -> None:
    sink = _Recording()
    stream = TickFlushed(sink, limit=1000)
    for _ in range(25):
        stream.write(b"x" * 99 + b"\n")
    assert len(sink.getvalue()) == 2000
    await asyncio.sleep(0)
    assert len(sink.getvalue()) == 2500


def test_without_a_running_loop_each_line_goes_out_at_once() -> None:
    sink = _Recording()
    stream = TickFlushed(sink)
    stream.write(b"one\n")
    assert sink.getvalue() == b"one\n"


def test_lines_left_by_a_loop_that_ended_are_written_out_later() -> None:
    sink = _Recording()
    stream = TickFlushed(sink)

    async def log_and_leave() -> None:
        stream.write(b"last words\n")

    loop = asyncio.new_event_loop()
    loop.run_until_complete(log_and_leave())
    loop.close()  # its scheduled write-out never ran
    asyncio.run(log_and_leave())  # a new loop schedules its own
    assert sink.getvalue() == b"last words\nlast words\n"
    stream.write_out()  # what atexit calls
    assert sink.getvalue() == b"last words\nlast words\n"
