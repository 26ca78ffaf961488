"""The service's field-table decoder (:mod:`consumer.amqp.field_table`): what pamqp decodes from a
valid table, for any bytes a result and never an exception, and the limits refused before decoding.

pamqp's own decoder is the oracle, taken from a private copy of ``pamqp.decode`` that
:func:`consumer.amqp.wire.install` has not touched.
"""

from __future__ import annotations

import decimal
import struct
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pamqp import commands, encode

from bench.hostile import flood_table, pristine_pamqp_decode
from consumer.amqp import wire
from consumer.amqp.field_table import (
    UNREADABLE_KEY,
    HeadersTooLarge,
    HeaderTooDeep,
    TableDecoder,
    TableLimits,
    UnreadableHeader,
)
from consumer.amqp.frames import decode_frame
from consumer.amqp.headers import trusted_headers
from consumer.errors import Poison, PoisonReason
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser
from tests.unit.amqp_values import header_values, same_value

PAMQP = pristine_pamqp_decode()
GENEROUS = TableDecoder(TableLimits(max_bytes=1 << 24, max_entries=1 << 20))
DEFAULT = TableDecoder(TableLimits())
EXAMPLES = settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def short(raw: bytes) -> bytes:
    return bytes([len(raw)]) + raw


def table(entries: bytes) -> bytes:
    return struct.pack(">I", len(entries)) + entries


# -- valid tables: as pamqp decodes them ---------------------------------------------------------

tables: st.SearchStrategy[Any] = st.dictionaries(st.text(max_size=12), header_values, max_size=8)

# Fields pamqp's encoder never writes, by hand, each valid: the type byte and its bytes.
raw_fields = st.one_of(
    st.integers(0, 255).map(lambda n: b"B" + struct.pack(">B", n)),
    st.integers(0, 2**16 - 1).map(lambda n: b"u" + struct.pack(">H", n)),
    st.integers(0, 2**32 - 1).map(lambda n: b"i" + struct.pack(">I", n)),
    st.integers(-(2**63), 2**63 - 1).map(lambda n: b"L" + struct.pack(">q", n)),
    st.floats(min_value=-3e38, max_value=3e38).map(lambda n: b"d" + struct.pack(">d", n)),
    st.tuples(st.integers(0, 255), st.integers(-(2**31), 2**31 - 1)).map(
        lambda d: b"D" + struct.pack(">Bi", *d)
    ),
    st.integers(0, 253402300799).map(lambda n: b"T" + struct.pack(">Q", n)),
    st.sampled_from([b"V", b"\x00"]),
)


@st.composite
def hand_tables(draw: st.DrawFn) -> bytes:
    keys = draw(st.lists(st.text(max_size=10), unique=True, max_size=8))
    entries = b"".join(short(key.encode()) + draw(raw_fields) for key in keys)
    return table(entries)


@EXAMPLES
@given(tables)
def test_a_table_pamqp_encodes_decodes_as_pamqp_decodes_it(value: dict[str, Any]) -> None:
    raw = encode.field_table(value)
    assert same_value(GENEROUS.table(raw), PAMQP.field_table(raw))
    # The same from a view of a larger buffer, as the fast path hands it over.
    expected = (len(raw), PAMQP.field_table(raw)[1])
    assert same_value(GENEROUS.table(memoryview(raw + b"rest")), expected)


@EXAMPLES
@given(hand_tables())
def test_every_field_type_decodes_as_pamqp_decodes_it(raw: bytes) -> None:
    assert same_value(GENEROUS.table(raw), PAMQP.field_table(raw))


@EXAMPLES
@given(st.lists(header_values, max_size=6))
def test_an_array_decodes_as_pamqp_decodes_it(value: list[Any]) -> None:
    raw = encode.field_array(value)
    assert same_value(GENEROUS.array(raw), PAMQP.field_array(raw))


def test_what_a_copy_could_not_carry_is_made_text_as_before() -> None:
    # Not UTF-8 (pamqp: bytes), a double past float32 (pamqp: a float no copy can encode), a
    # timestamp past the year 9999 (pamqp: OverflowError).
    entries = short(b"s") + b"S" + struct.pack(">I", 3) + b"a\xffb"
    entries += short(b"d") + b"d" + struct.pack(">d", 1e300)
    entries += short(b"t") + b"T" + struct.pack(">Q", 2**64 - 1)
    consumed, decoded = GENEROUS.table(table(entries))
    assert consumed == len(entries) + 4
    assert decoded["s"] == "a\ufffdb"
    assert decoded["d"] == "1e+300"
    assert isinstance(decoded["t"], UnreadableHeader)
    assert decoded["t"] == "a timestamp out of range"
    assert GENEROUS.table(table(short(b"x") + b"D" + struct.pack(">Bi", 2, 12345)))[1] == {
        "x": decimal.Decimal("123.45")
    }


# -- any bytes: a result, never an exception -----------------------------------------------------


@settings(max_examples=2000, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=300), st.integers(0, 4))
def test_any_bytes_decode_to_a_table_or_a_stand_in(raw: bytes, cut: int) -> None:
    for buffer in (raw, raw[cut:], memoryview(raw)):
        consumed, decoded = DEFAULT.table(buffer)
        assert 0 <= consumed <= len(buffer)
        assert isinstance(decoded, dict)
        consumed, items = DEFAULT.array(buffer)
        assert 0 <= consumed <= len(buffer)
        assert isinstance(items, list | UnreadableHeader)


@EXAMPLES
@given(tables, st.data())
def test_a_mangled_table_decodes_to_a_table_or_a_stand_in(
    value: dict[str, Any], data: st.DataObject
) -> None:
    raw = bytearray(encode.field_table(value))
    for _ in range(data.draw(st.integers(1, 4))):
        raw[data.draw(st.integers(0, len(raw) - 1))] ^= data.draw(st.integers(1, 255))
    consumed, decoded = DEFAULT.table(bytes(raw))
    assert 0 <= consumed <= len(raw)
    assert isinstance(decoded, dict)


# -- the limits, refused before decoding ---------------------------------------------------------


def stand_in(decoded: dict[str, Any]) -> UnreadableHeader:
    assert list(decoded) == [UNREADABLE_KEY], decoded
    value = decoded[UNREADABLE_KEY]
    assert isinstance(value, UnreadableHeader)
    return value


def test_issue_29s_header_flood_is_refused_by_its_length_before_decoding() -> None:
    # 60,000 entries sharing one (empty) key, 120 KB: pamqp decoded it in 170 ms to {"": None}.
    flood = flood_table(60_000)
    consumed, decoded = DEFAULT.table(flood)
    assert consumed == len(flood)
    refused = stand_in(decoded)
    assert type(refused) is HeadersTooLarge
    assert refused == "headers of 120000 bytes, over the limit of 65536"


def test_a_table_over_the_byte_limit_is_not_decoded_at_all() -> None:
    # Its content would be unreadable (an unknown type): it is refused for its length alone.
    garbage = table(short(b"k") + b"?" * 2000)
    assert type(stand_in(TableDecoder(TableLimits(max_bytes=1024)).table(garbage)[1])) is (
        HeadersTooLarge
    )
    assert type(stand_in(DEFAULT.table(garbage)[1])) is UnreadableHeader


def test_a_key_twice_in_one_table_makes_it_unreadable_at_any_depth() -> None:
    twice = (short(b"a") + b"b" + b"\x01") + (short(b"a") + b"b" + b"\x02")
    refused = stand_in(DEFAULT.table(table(twice))[1])
    assert type(refused) is UnreadableHeader
    assert refused == "unreadable headers (the key 'a' twice in one table)"
    # Nested: that table alone stands in; the rest of the headers are decoded.
    nested = short(b"n") + b"F" + table(twice) + short(b"ok") + b"t" + b"\x01"
    decoded = DEFAULT.table(table(nested))[1]
    assert decoded["ok"] is True
    assert type(decoded["n"]) is UnreadableHeader
    # The flood of issue 29 with the byte limit lifted: refused at its second entry.
    lifted = TableDecoder(TableLimits(max_bytes=1 << 20, max_entries=1 << 20))
    assert "the key '' twice" in stand_in(lifted.table(flood_table(60_000))[1])


def test_entries_are_counted_over_every_table_and_array_in_the_headers() -> None:
    decoder = TableDecoder(TableLimits(max_entries=10))

    def voids(count: int) -> bytes:
        return b"".join(short(str(n).encode()) + b"V" for n in range(count))

    assert len(decoder.table(table(voids(10)))[1]) == 10
    assert stand_in(decoder.table(table(voids(11)))[1]) == "headers of more than 10 entries"
    # One key holding an array of nine: ten entries; of ten: eleven.
    assert decoder.table(table(short(b"a") + b"A" + table(b"V" * 9)))[1] == {"a": [None] * 9}
    array = short(b"a") + b"A" + table(b"V" * 10)
    assert type(stand_in(decoder.table(table(array))[1])) is HeadersTooLarge
    # A nested table's entries count too.
    assert len(decoder.table(table(short(b"t") + b"F" + table(voids(9))))[1]["t"]) == 9
    inner = short(b"t") + b"F" + table(voids(10))
    assert type(stand_in(decoder.table(table(inner))[1])) is HeadersTooLarge


def hand_nested(depth: int) -> bytes:
    value = table(b"")
    for _ in range(depth):
        value = table(short(b"a") + b"F" + value)
    return value


@pytest.mark.parametrize("depth", [16, 17, 5000])
def test_nesting_past_the_depth_limit_stands_in_for_the_deep_value_alone(depth: int) -> None:
    consumed, decoded = DEFAULT.table(hand_nested(depth))
    assert consumed == len(hand_nested(depth))
    levels = 0
    value: Any = decoded
    while isinstance(value, dict) and value:
        value = value["a"]
        levels += 1
    if depth <= 16:
        assert value == {}
        assert levels == depth
    else:
        assert type(value) is HeaderTooDeep
        assert levels == 17


def test_a_value_longer_than_its_table_is_unreadable() -> None:
    # The string says 10,000 bytes; the table holds five. pamqp read past the table's end.
    lying = short(b"k") + b"S" + struct.pack(">I", 10_000) + b"short"
    assert type(stand_in(DEFAULT.table(table(lying) + b"x" * 20_000)[1])) is UnreadableHeader


# -- what the service makes of them --------------------------------------------------------------


def headers_frame(raw_table: bytes) -> bytes:
    flags = commands.Basic.Properties.flags["headers"]
    payload = struct.pack(">HHQH", 60, 0, 2, flags) + raw_table
    return struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce"


@pytest.mark.parametrize(
    ("raw_table", "reason"),
    [
        (flood_table(60_000), PoisonReason.HEADERS_TOO_LARGE),
        (
            table(b"".join(short(str(n).encode()) + b"V" for n in range(1025))),
            PoisonReason.HEADERS_TOO_LARGE,
        ),
        (table((short(b"attempt") + b"b" + b"\x01") * 2), PoisonReason.HEADERS_UNREADABLE),
        (hand_nested(40), PoisonReason.HEADERS_TOO_DEEP),
    ],
    ids=["issue-29-flood", "1025-entries", "a-key-twice", "40-deep"],
)
def test_a_producers_headers_past_the_limits_are_poison(
    raw_table: bytes, reason: PoisonReason
) -> None:
    """The issue: 60,000 entries sharing one key decoded to a single key, under the header limit,
    and the event was applied."""
    wire.install(EnvelopeLimits().header_tables())
    headers = decode_frame(headers_frame(raw_table)).properties.headers
    parser = EnvelopeParser(EnvelopeLimits())
    with pytest.raises(Poison) as poison:
        parser.check_headers(trusted_headers(headers, trusted=False))
    assert poison.value.reason is reason
