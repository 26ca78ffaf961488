"""``decode_frame`` builds what pamqp builds from the same frame, and fails where pamqp fails.

pamqp (after :func:`consumer.amqp.wire.install`, whose total decoders the fast path shares) is the
oracle: every frame, whole or mangled, is decoded both ways and the results compared attribute by
attribute, types included (an ``UnreadableHeader`` is a ``str`` that must stay itself).
"""

from __future__ import annotations

import datetime
import decimal
import re
import string
import struct
from typing import Any

import pytest
from aiormq.exceptions import InvalidFrameError
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import body, commands, encode, header, heartbeat
from pamqp import frame as pamqp_frame
from pamqp.exceptions import PAMQPException

from consumer.amqp import wire
from consumer.amqp.frames import decode_frame
from tests.unit.amqp_values import header_values, same_value

# Process-wide and idempotent; the fast path reads through these decoders, so the oracle must too.
wire.install()

PROPERTY_NAMES = tuple(commands.Basic.Properties.__slots__)
DELIVER_INDEX = struct.pack(">I", commands.Basic.Deliver.index)
HEARTBEAT = b"\x08\x00\x00\x00\x00\x00\x00\xce"
EXAMPLES = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# --- comparing frames ---------------------------------------------------------------------------


def frame_fields(frame: Any) -> dict[str, Any]:
    """What a frame is: its class's slots, a content header's properties one by one."""
    if isinstance(frame, header.ContentHeader):
        fields = {name: getattr(frame, name) for name in ("class_id", "weight", "body_size")}
        for name in PROPERTY_NAMES:
            fields["properties." + name] = getattr(frame.properties, name)
        return fields
    slots = getattr(type(frame), "__slots__", None)
    if slots:
        return {name: getattr(frame, name) for name in slots}
    return dict(vars(frame))  # ContentBody, Heartbeat, ProtocolHeader


def assert_same_frame(got: Any, expected: Any) -> None:
    assert type(got) is type(expected)
    got_fields, expected_fields = frame_fields(got), frame_fields(expected)
    assert same_value(got_fields, expected_fields), (got_fields, expected_fields)


def without_addresses(text: str) -> str:
    return re.sub(r" at 0x[0-9a-fA-F]+", "", text)


def assert_decodes_as_pamqp(frame: bytes) -> None:
    """Both decode to the same frame, or pamqp refuses it and decode_frame raises what aiormq
    raises for that (InvalidFrameError with pamqp's words)."""
    refusal: Exception | None = None
    try:
        expected = pamqp_frame.unmarshal(frame)[2]
    except Exception as error:
        refusal = error
    if refusal is None:
        assert_same_frame(decode_frame(frame), expected)
    elif isinstance(refusal, PAMQPException):
        with pytest.raises(InvalidFrameError) as raised:
            decode_frame(frame)
        # pamqp's words name the frame object it built ("<Basic.Ack object at 0x...>").
        assert without_addresses(str(raised.value)) == without_addresses(
            str(InvalidFrameError(str(refusal)))
        )
    else:  # not pamqp's own refusal: the same must escape both ways
        with pytest.raises(type(refusal)):
            decode_frame(frame)


# --- building frames ----------------------------------------------------------------------------


def short(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def method_frame(payload: bytes, channel: int = 1) -> bytes:
    return struct.pack(">BHI", 1, channel, len(payload)) + payload + b"\xce"


def header_frame(payload: bytes, channel: int = 1) -> bytes:
    return struct.pack(">BHI", 2, channel, len(payload)) + payload + b"\xce"


def with_payload(frame: bytes, payload: bytes) -> bytes:
    """``frame``'s type and channel around another payload, the size field made to match."""
    return frame[:3] + struct.pack(">I", len(payload)) + payload + frame[-1:]


short_texts = st.text(max_size=60).filter(lambda text: len(text.encode()) <= 255)
exchange_names = st.text(alphabet=string.ascii_letters + string.digits + "-_.:@#,/+ ", max_size=127)
delivery_tags = st.integers(-(2**63), 2**63 - 1) | st.sampled_from(
    [0, 1, 2**31, 2**32, 2**53 + 1, 2**63 - 1]
)
# Raw short strings: non-ASCII, invalid UTF-8, a multi-byte character cut at the end.
raw_shorts = st.binary(max_size=255) | st.sampled_from(
    [b"\xff\xfe", "é".encode()[:1], "ключ".encode(), b"\x00", b"\xed\xa0\x80"]
)

# Any: pamqp types its tables narrower than the values its encoder takes.
header_tables: st.SearchStrategy[Any] = st.dictionaries(
    st.text(max_size=12), header_values, max_size=6
)

property_values: dict[str, st.SearchStrategy[Any]] = {
    "content_type": short_texts,
    "content_encoding": short_texts,
    "headers": header_tables,
    "delivery_mode": st.integers(0, 255),
    "priority": st.integers(0, 255),
    "correlation_id": short_texts,
    "reply_to": short_texts,
    "expiration": short_texts,
    "message_id": short_texts,
    "timestamp": st.datetimes(
        min_value=datetime.datetime(1970, 1, 1), max_value=datetime.datetime(9999, 12, 31)
    ),
    "message_type": short_texts,
    "user_id": short_texts,
    "app_id": short_texts,
    "cluster_id": short_texts,
}


@st.composite
def properties(draw: st.DrawFn) -> commands.Basic.Properties:
    """Any subset of Basic's 14 properties."""
    chosen = draw(st.sets(st.sampled_from(PROPERTY_NAMES)))
    value = commands.Basic.Properties()
    for name in chosen:
        # Assigned after __init__: its validation refuses a cluster_id, which a broker may send.
        setattr(value, name, draw(property_values[name]))
    return value


@st.composite
def raw_property_bytes(draw: st.DrawFn) -> tuple[int, bytes]:
    """Property flags and values encoded by hand: short strings that are not UTF-8, timestamps
    past the year 9999, header tables of random bytes or with lying lengths."""
    flags, parts = 0, []
    for name in PROPERTY_NAMES:
        if not draw(st.booleans()):
            continue
        flags |= commands.Basic.Properties.flags[name]
        amqp_type = getattr(commands.Basic.Properties, "_" + name)
        if amqp_type == "shortstr":
            parts.append(short(draw(raw_shorts)))
        elif amqp_type == "octet":
            parts.append(bytes([draw(st.integers(0, 255))]))
        elif amqp_type == "timestamp":
            parts.append(struct.pack(">Q", draw(st.integers(0, 2**64 - 1))))
        else:
            table = draw(
                header_tables.map(encode.field_table)
                | st.binary(max_size=40).map(lambda raw: struct.pack(">I", len(raw)) + raw)
                | st.tuples(st.integers(0, 2**32 - 1), st.binary(max_size=40)).map(
                    lambda lie: struct.pack(">I", lie[0]) + lie[1]
                )
            )
            parts.append(table)
    return flags, b"".join(parts)


@st.composite
def deliver_frames(draw: st.DrawFn) -> bytes:
    """Basic.Deliver as pamqp marshals it, or by hand with any bytes in its short strings."""
    channel = draw(st.integers(0, 2**16 - 1))
    if draw(st.booleans()):
        deliver = commands.Basic.Deliver(
            consumer_tag=draw(short_texts),
            delivery_tag=draw(delivery_tags),
            redelivered=draw(st.booleans()),
            exchange=draw(exchange_names),
            routing_key=draw(short_texts),
        )
        return pamqp_frame.marshal(deliver, channel)
    payload = (
        DELIVER_INDEX
        + short(draw(raw_shorts))
        + struct.pack(">q", draw(delivery_tags))
        + bytes([draw(st.integers(0, 255))])  # the redelivered bit, and bits nobody defined
        + short(draw(raw_shorts))
        + short(draw(raw_shorts))
        + draw(st.binary(max_size=4))  # trailing bytes pamqp ignores
    )
    return method_frame(payload, channel)


@st.composite
def content_header_frames(draw: st.DrawFn) -> bytes:
    channel = draw(st.integers(0, 2**16 - 1))
    body_size = draw(st.integers(0, 2**64 - 1))
    if draw(st.booleans()):
        content = header.ContentHeader(0, body_size, draw(properties()))
        return pamqp_frame.marshal(content, channel)
    flags, values = draw(raw_property_bytes())
    class_id, weight = draw(st.sampled_from([60, 0, 10])), draw(st.sampled_from([0, 7]))
    flag_words = struct.pack(">H", flags)
    if draw(st.booleans()):  # a continuation flag word, which no property uses
        flag_words = struct.pack(">HH", flags | 1, draw(st.integers(0, 2**16 - 1)) & 0xFFFE)
    payload = struct.pack(">HHQ", class_id, weight, body_size) + flag_words + values
    return header_frame(payload, channel)


body_frames = st.builds(
    lambda value, channel: pamqp_frame.marshal(body.ContentBody(value), channel),
    st.binary(min_size=1, max_size=300),
    st.integers(0, 2**16 - 1),
)
other_frames = st.sampled_from(
    [
        pamqp_frame.marshal(commands.Basic.Ack(delivery_tag=7, multiple=True), 1),
        pamqp_frame.marshal(commands.Basic.Nack(delivery_tag=2**40, requeue=False), 3),
        pamqp_frame.marshal(commands.Channel.Close(404, "NOT_FOUND - no queue 'q'", 60, 20), 1),
        pamqp_frame.marshal(commands.Connection.Close(320, "CONNECTION_FORCED", 0, 0), 0),
        pamqp_frame.marshal(commands.Basic.ConsumeOk("ctag.1"), 1),
        pamqp_frame.marshal(commands.Basic.GetOk(5, False, "ex", "rk", 0), 1),
        HEARTBEAT,
    ]
)
any_frames = deliver_frames() | content_header_frames() | body_frames | other_frames


# --- whole frames -------------------------------------------------------------------------------


@EXAMPLES
@given(deliver_frames())
def test_a_deliver_frame_decodes_as_pamqp_decodes_it(frame: bytes) -> None:
    assert_decodes_as_pamqp(frame)


@EXAMPLES
@given(content_header_frames())
def test_a_content_header_decodes_as_pamqp_decodes_it(frame: bytes) -> None:
    assert_decodes_as_pamqp(frame)


@EXAMPLES
@given(body_frames)
def test_a_body_frame_decodes_as_pamqp_decodes_it(frame: bytes) -> None:
    assert_decodes_as_pamqp(frame)


@pytest.mark.parametrize(
    "frame",
    [
        HEARTBEAT,
        pamqp_frame.marshal(commands.Basic.Ack(delivery_tag=1), 1),
        pamqp_frame.marshal(commands.Channel.Close(406, "PRECONDITION_FAILED", 60, 80), 2),
        pamqp_frame.marshal(commands.Basic.CancelOk("ctag"), 1),
        b"AMQP\x00\x00\x09\x01",  # the broker's protocol header
    ],
    ids=["heartbeat", "basic.ack", "channel.close", "basic.cancel-ok", "protocol-header"],
)
def test_frames_off_the_fast_path_are_pamqps(frame: bytes) -> None:
    assert_decodes_as_pamqp(frame)


def test_a_delivery_tag_past_two_to_the_63_reads_as_pamqp_reads_it() -> None:
    # The tag is a signed long-long in pamqp: a broker's 2**63 comes out negative, the same way.
    payload = (
        DELIVER_INDEX + short(b"c") + b"\x80" + b"\x00" * 7 + b"\x01" + short(b"") + short(b"k")
    )
    decoded = decode_frame(method_frame(payload))
    assert decoded.delivery_tag == -(2**63)
    assert decoded.redelivered is True
    assert_decodes_as_pamqp(method_frame(payload))


def test_invalid_utf8_in_a_routing_key_becomes_replacement_characters() -> None:
    payload = DELIVER_INDEX + short(b"c") + struct.pack(">q", 1) + b"\x00" + short(b"e\xff")
    payload += short(b"r\xfe\xff")
    decoded = decode_frame(method_frame(payload))
    assert (decoded.exchange, decoded.routing_key) == ("e\ufffd", "r\ufffd\ufffd")
    assert_decodes_as_pamqp(method_frame(payload))


# --- mangled frames -----------------------------------------------------------------------------


@EXAMPLES
@given(any_frames, st.data())
def test_a_frame_cut_short_decodes_or_fails_as_pamqp(frame: bytes, data: st.DataObject) -> None:
    # Cut to at least one byte: an empty payload is its own (failing) case below.
    payload = frame[7:-1]
    if len(payload) < 2:
        return
    kept = data.draw(st.integers(1, len(payload) - 1))
    assert_decodes_as_pamqp(with_payload(frame, payload[:kept]))


@EXAMPLES
@given(any_frames, st.data())
def test_a_frame_with_flipped_bytes_decodes_or_fails_as_pamqp(
    frame: bytes, data: st.DataObject
) -> None:
    # Any byte but the size field's (decode_frame is given frames cut at their size, so size
    # and length always agree) and the end byte (its own case below).
    positions = [*range(3), *range(7, len(frame) - 1)]
    mangled = bytearray(frame)
    for position in data.draw(st.lists(st.sampled_from(positions), min_size=1, max_size=4)):
        mangled[position] ^= data.draw(st.integers(1, 255))
    assert_decodes_as_pamqp(bytes(mangled))


@pytest.mark.parametrize("frame_type", [0, 4, 9, 65, 206, 255])
def test_an_unknown_frame_type_fails_as_in_pamqp(frame_type: int) -> None:
    frame = bytes([frame_type]) + pamqp_frame.marshal(body.ContentBody(b"xyz"), 1)[1:]
    assert_decodes_as_pamqp(frame)


@pytest.mark.parametrize(
    "frame",
    [
        pamqp_frame.marshal(body.ContentBody(b"a body"), 1),
        pamqp_frame.marshal(commands.Basic.Ack(delivery_tag=1), 1),
        pamqp_frame.marshal(
            header.ContentHeader(0, 5, commands.Basic.Properties(content_type="x")), 1
        ),
        pamqp_frame.marshal(commands.Basic.Deliver("ctag", 1, False, "ex", "rk"), 1),
    ],
    ids=["body", "basic.ack", "content-header", "basic.deliver"],
)
def test_a_wrong_frame_end_fails_as_in_pamqp(frame: bytes) -> None:
    # pamqp refuses a frame whose last byte is not 0xCE ("Last byte error"): the stream has lost
    # its framing, and aiormq closes the connection on InvalidFrameError.
    assert_decodes_as_pamqp(frame[:-1] + b"\x00")


@pytest.mark.parametrize("frame_type", [1, 2, 3])
def test_an_empty_payload_fails_as_in_pamqp(frame_type: int) -> None:
    # pamqp refuses a size of 0 for every frame but a heartbeat ("No frame size").
    assert_decodes_as_pamqp(bytes([frame_type]) + b"\x00\x01\x00\x00\x00\x00\xce")


def test_no_bytes_at_all_fail_as_in_pamqp() -> None:
    assert_decodes_as_pamqp(b"")


# --- hostile headers ----------------------------------------------------------------------------


def nested_table(depth: int) -> dict[str, Any]:
    table: dict[str, Any] = {"leaf": "bottom"}
    for _ in range(depth):
        table = {"a": table}
    return table


def hand_nested_table(depth: int) -> bytes:
    """A table nested ``depth`` deep, built without recursion (pamqp's encoder would need it)."""
    table = struct.pack(">I", 0)
    for _ in range(depth):
        entry = short(b"a") + b"F" + table
        table = struct.pack(">I", len(entry)) + entry
    return table


def headers_frame(table: bytes) -> bytes:
    flags = commands.Basic.Properties.flags["headers"]
    return header_frame(struct.pack(">HHQH", 60, 0, 3, flags) + table)


@pytest.mark.parametrize(
    "table",
    [
        encode.field_table(nested_table(100)),
        hand_nested_table(100),
        hand_nested_table(5000),
        encode.field_table({"list": [[[[[[[[[[[[[[[[[[[["deep"]]]]]]]]]]]]]]]]]]]]}),
    ],
    ids=["100-deep-by-pamqp", "100-deep-by-hand", "5000-deep-by-hand", "arrays-20-deep"],
)
def test_a_header_nested_too_deep_decodes_to_the_stand_in_pamqp_gives(table: bytes) -> None:
    frame = headers_frame(table)
    decoded = decode_frame(frame)  # never raises
    assert_same_frame(decoded, pamqp_frame.unmarshal(frame)[2])
    # Somewhere down the table is the stand-in the envelope parser makes poison.
    value: Any = decoded.properties.headers
    while isinstance(value, dict | list):
        value = next(iter(value.values())) if isinstance(value, dict) else value[0]
    assert isinstance(value, wire.HeaderTooDeep)


def test_a_header_table_that_lies_about_its_length_decodes_as_in_pamqp() -> None:
    entry = short(b"k") + b"S" + struct.pack(">I", 10_000) + b"short"
    frame = headers_frame(struct.pack(">I", len(entry)) + entry)
    decoded = decode_frame(frame)
    assert_same_frame(decoded, pamqp_frame.unmarshal(frame)[2])


def test_a_timestamp_past_the_year_9999_is_dropped_as_in_pamqp() -> None:
    flags = commands.Basic.Properties.flags["timestamp"]
    payload = struct.pack(">HHQHQ", 60, 0, 0, flags, 2**64 - 1)
    decoded = decode_frame(header_frame(payload))
    assert decoded.properties.timestamp is None
    assert_decodes_as_pamqp(header_frame(payload))


def test_a_header_decimal_and_a_double_decode_as_in_pamqp() -> None:
    entries = short(b"d") + b"D" + struct.pack(">Bi", 2, 12345)
    entries += short(b"f") + b"d" + struct.pack(">d", 1e300)  # past float32: wire makes it text
    frame = headers_frame(struct.pack(">I", len(entries)) + entries)
    decoded = decode_frame(frame)
    assert decoded.properties.headers == {"d": decimal.Decimal("123.45"), "f": "1e+300"}
    assert_decodes_as_pamqp(frame)


def test_a_heartbeat_is_a_heartbeat() -> None:
    assert isinstance(decode_frame(HEARTBEAT), heartbeat.Heartbeat)
