"""``BulkFrameReceiver`` yields the frames aiormq's own receiver yields, however the bytes arrive.

The bytes are fed to an ``asyncio.StreamReader`` in chunks of every size; what comes out is
compared with pamqp's ``unmarshal`` of each frame and with aiormq's ``FrameReceiver`` fed the same
chunks, errors and the end of the stream included.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Coroutine, Sequence
from typing import Any, TypeVar

import aiormq.connection
import pytest
from aiormq.exceptions import AMQPConnectionError, InvalidFrameError, ProtocolSyntaxError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import body, commands, header
from pamqp import frame as pamqp_frame
from pamqp.exceptions import PAMQPException

from consumer.amqp import frames, wire
from consumer.amqp.frames import BulkFrameReceiver
from tests.unit.test_frames_decode import HEARTBEAT, any_frames, assert_same_frame

wire.install()

# aiormq's own receiver, whatever frames.install() has done to the module-level name.
AIORMQ_RECEIVER: type[aiormq.connection.FrameReceiver] = BulkFrameReceiver.__bases__[0]
EXAMPLES = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
T = TypeVar("T")

DELIVERY = [
    pamqp_frame.marshal(commands.Basic.Deliver("ctag", 1, False, "events", "order.created"), 1),
    pamqp_frame.marshal(
        header.ContentHeader(0, 11, commands.Basic.Properties(message_id="m-1", headers={})), 1
    ),
    pamqp_frame.marshal(body.ContentBody(b'{"id": "1"}'), 1),
]

Outcome = tuple[list[tuple[int, int, Any]], type[BaseException] | None]
"""The frames received, then the exception that ended the stream (None: it ended cleanly)."""


def run(coroutine: Coroutine[Any, Any, T]) -> T:
    # A loop of its own: hypothesis calls this test body many times, outside pytest-asyncio's.
    loop = asyncio.new_event_loop()
    try:
        return loop.run_until_complete(coroutine)
    finally:
        loop.close()


async def receive(
    receiver_class: type[aiormq.connection.FrameReceiver], chunks: Sequence[bytes]
) -> Outcome:
    """Feed ``chunks`` one turn of the loop apart, the end of the stream with the last one."""
    reader = asyncio.StreamReader()
    receiver = receiver_class(reader)

    async def feed() -> None:
        for chunk in chunks:
            await asyncio.sleep(0)
            reader.feed_data(chunk)
        reader.feed_eof()

    feeder = asyncio.create_task(feed())
    received: list[tuple[int, int, Any]] = []
    ended_by: type[BaseException] | None = None
    try:
        async for frame in receiver:
            received.append(frame)
    except Exception as error:
        ended_by = type(error)
    await feeder
    return received, ended_by


def pamqps(stream_frames: Sequence[bytes]) -> Outcome:
    """What aiormq would yield for these frames: pamqp's, up to the first it refuses."""
    expected: list[tuple[int, int, Any]] = []
    for frame in stream_frames:
        try:
            expected.append(pamqp_frame.unmarshal(frame))
        except PAMQPException:
            return expected, InvalidFrameError
    return expected, None


def assert_same_outcome(got: Outcome, expected: Outcome) -> None:
    got_frames, got_end = got
    expected_frames, expected_end = expected
    assert got_end is expected_end
    assert len(got_frames) == len(expected_frames)
    for (size, channel, frame), (want_size, want_channel, want_frame) in zip(
        got_frames, expected_frames, strict=True
    ):
        assert (size, channel) == (want_size, want_channel)
        assert_same_frame(frame, want_frame)


def cut(stream: bytes, points: Sequence[int]) -> list[bytes]:
    bounds = [0, *sorted({point % (len(stream) + 1) for point in points}), len(stream)]
    # No empty chunk: the end of the stream must come with the last bytes (see below for the
    # end arriving alone, while the receiver waits).
    chunks = [stream[start:end] for start, end in itertools.pairwise(bounds)]
    return [chunk for chunk in chunks if chunk]


@EXAMPLES
@given(st.lists(any_frames, min_size=1, max_size=12), st.lists(st.integers(0, 10**6)))
def test_frames_split_anywhere_come_out_as_pamqp_decodes_them(
    stream_frames: list[bytes], points: list[int]
) -> None:
    chunks = cut(b"".join(stream_frames), points)
    assert_same_outcome(run(receive(BulkFrameReceiver, chunks)), pamqps(stream_frames))


@EXAMPLES
@given(st.lists(any_frames, min_size=1, max_size=12), st.lists(st.integers(0, 10**6)))
def test_frames_split_anywhere_come_out_as_from_aiormqs_receiver(
    stream_frames: list[bytes], points: list[int]
) -> None:
    chunks = cut(b"".join(stream_frames), points)
    assert_same_outcome(
        run(receive(BulkFrameReceiver, chunks)), run(receive(AIORMQ_RECEIVER, chunks))
    )


def test_a_delivery_fed_one_byte_at_a_time_comes_out_whole() -> None:
    stream = b"".join([*DELIVERY, HEARTBEAT, *DELIVERY])
    chunks = [stream[index : index + 1] for index in range(len(stream))]
    got = run(receive(BulkFrameReceiver, chunks))
    assert_same_outcome(got, pamqps([*DELIVERY, HEARTBEAT, *DELIVERY]))
    assert [size for size, _, _ in got[0]][3] == 8  # the heartbeat's header and end


def test_many_frames_in_one_chunk_come_out_in_order() -> None:
    stream_frames = [*DELIVERY * 50, HEARTBEAT]
    assert_same_outcome(
        run(receive(BulkFrameReceiver, [b"".join(stream_frames)])), pamqps(stream_frames)
    )


def test_a_megabyte_of_frames_in_odd_chunks_comes_out_frame_by_frame() -> None:
    # Past the receiver's read size: the buffer is cut back while a frame is still in it.
    stream_frames = [
        pamqp_frame.marshal(body.ContentBody(bytes([n % 251]) * (n % 7000 + 1)), n % 5)
        for n in range(300)
    ]
    stream = b"".join(stream_frames)
    chunks = [stream[start : start + 99_991] for start in range(0, len(stream), 99_991)]
    assert_same_outcome(run(receive(BulkFrameReceiver, chunks)), pamqps(stream_frames))


def test_a_body_frame_larger_than_one_read_arrives_whole() -> None:
    frame = pamqp_frame.marshal(body.ContentBody(b"x" * 600_000), 1)
    assert_same_outcome(
        run(receive(BulkFrameReceiver, [frame[:1000], frame[1000:]])), pamqps([frame])
    )


async def test_the_end_of_the_stream_with_nothing_held_stops_the_iteration() -> None:
    reader = asyncio.StreamReader()
    reader.feed_data(DELIVERY[2])
    reader.feed_eof()
    receiver = BulkFrameReceiver(reader)
    assert (await receiver.get_frame())[0] == len(DELIVERY[2])
    with pytest.raises(StopAsyncIteration):
        await receiver.get_frame()


@pytest.mark.parametrize("kept", [1, 6, 7, 8, 20, len(DELIVERY[1]) - 1])
@pytest.mark.parametrize("receiver_class", [BulkFrameReceiver, AIORMQ_RECEIVER])
def test_the_end_of_the_stream_inside_a_frame_is_a_connection_error(
    receiver_class: type[aiormq.connection.FrameReceiver], kept: int
) -> None:
    # Cut in the frame header, just after it, in the payload, before the frame end.
    got = run(receive(receiver_class, [DELIVERY[0], DELIVERY[1][:kept]]))
    assert_same_outcome(got, (pamqps(DELIVERY[:1])[0], AMQPConnectionError))


@pytest.mark.parametrize("receiver_class", [BulkFrameReceiver, AIORMQ_RECEIVER])
async def test_the_end_of_the_stream_while_waiting_for_a_frame_is_a_connection_error(
    receiver_class: type[aiormq.connection.FrameReceiver],
) -> None:
    # aiormq's receiver is already reading when the socket closes: it reads 0 bytes of the next
    # frame. The bulk receiver says the same, rather than ending the iteration.
    reader = asyncio.StreamReader()
    receiver = receiver_class(reader)
    waiting = asyncio.ensure_future(receiver.get_frame())
    await asyncio.sleep(0)
    reader.feed_eof()
    with pytest.raises(AMQPConnectionError):
        await waiting


@pytest.mark.parametrize("receiver_class", [BulkFrameReceiver, AIORMQ_RECEIVER])
def test_the_brokers_protocol_header_first_is_a_protocol_syntax_error(
    receiver_class: type[aiormq.connection.FrameReceiver],
) -> None:
    # What a broker sends back when it refuses the client's protocol version.
    got = run(receive(receiver_class, [b"AMQP\x00\x00\x09\x01"]))
    assert got == ([], ProtocolSyntaxError)


def test_an_invalid_frame_in_the_stream_is_an_invalid_frame_error() -> None:
    ack = pamqp_frame.marshal(commands.Basic.Ack(delivery_tag=1), 1)
    stream_frames = [*DELIVERY, ack[:-1] + b"\x00"]
    got = run(receive(BulkFrameReceiver, [b"".join(stream_frames)]))
    assert_same_outcome(got, (pamqps(DELIVERY)[0], InvalidFrameError))


def test_async_for_ends_at_the_end_of_the_stream() -> None:
    got, ended_by = run(receive(BulkFrameReceiver, [b"".join(DELIVERY)]))
    assert (len(got), ended_by) == (3, None)


def test_install_puts_the_bulk_receiver_in_aiormqs_place(monkeypatch: pytest.MonkeyPatch) -> None:
    # Set first so that monkeypatch puts back whatever was there after the test.
    monkeypatch.setattr(aiormq.connection, "FrameReceiver", AIORMQ_RECEIVER)
    frames.install()
    assert aiormq.connection.FrameReceiver is BulkFrameReceiver


@pytest.mark.parametrize("receiver_class", [BulkFrameReceiver, AIORMQ_RECEIVER])
def test_a_content_header_with_a_wrong_frame_end_stops_the_stream(
    receiver_class: type[aiormq.connection.FrameReceiver],
) -> None:
    # The frame end is where the size says the frame ends: a wrong byte there means the stream
    # has lost its framing, and aiormq's receiver refuses it (the connection is closed).
    stream_frames = [DELIVERY[0], DELIVERY[1][:-1] + b"\x00", DELIVERY[2]]
    got = run(receive(receiver_class, [b"".join(stream_frames)]))
    assert_same_outcome(got, (pamqps(DELIVERY[:1])[0], InvalidFrameError))


LARGE_BODY = [
    pamqp_frame.marshal(body.ContentBody(bytes([n]) * (128 * 1024 - 8 - n)), 1) for n in range(5)
]


@pytest.mark.parametrize("chunk", [1000, 65_536, 99_991, 131_072, 262_144, 400_000])
def test_large_body_frames_read_in_one_piece_come_out_as_pamqp_decodes_them(chunk: int) -> None:
    # The rest of a large body frame is read in one piece (frames._LARGE_BODY_FRAME), whatever
    # the reads had cut off; deliveries and heartbeats between them go the buffer's way.
    stream_frames = [*DELIVERY, *LARGE_BODY[:2], HEARTBEAT, *DELIVERY, *LARGE_BODY[2:]]
    stream = b"".join(stream_frames)
    chunks = [stream[start : start + chunk] for start in range(0, len(stream), chunk)]
    assert_same_outcome(run(receive(BulkFrameReceiver, chunks)), pamqps(stream_frames))


def test_a_large_body_frame_without_its_frame_end_is_an_invalid_frame_error() -> None:
    broken = LARGE_BODY[0][:-1] + b"\x00"
    got = run(receive(BulkFrameReceiver, [broken[:1000], broken[1000:]]))
    assert_same_outcome(got, ([], InvalidFrameError))


def test_the_end_of_the_stream_inside_a_large_body_frame_is_a_connection_error() -> None:
    got = run(receive(BulkFrameReceiver, [DELIVERY[0], LARGE_BODY[0][:70_000]]))
    assert_same_outcome(got, (pamqps(DELIVERY[:1])[0], AMQPConnectionError))
