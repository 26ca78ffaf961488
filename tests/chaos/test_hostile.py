"""What the suite's producer puts on the wire for a hostile producer's messages is what the kind
says, as the service's hardened decoder reads it back (no broker needed)."""

from __future__ import annotations

from typing import Any

import pytest
from pamqp.commands import Basic
from pamqp.header import ContentHeader

from consumer.amqp import wire
from consumer.amqp.headers import attempts_so_far, trusted_headers
from consumer.errors import Poison, PoisonReason
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser
from tests.chaos import hostile
from tests.chaos.hostile import Wire


def read_back(kind: Wire) -> Basic.Properties:
    """The properties the producer sends for ``kind``, decoded as the service decodes them."""
    sent = Basic.Properties(
        headers=hostile.headers(kind), message_id=hostile.message_id(kind, "k000001.0~1")
    )
    with hostile.hostile_encoding():
        frame = ContentHeader(body_size=2, properties=sent).marshal()
    wire.install()
    received = ContentHeader()
    received.unmarshal(frame)
    return received.properties


def headers_of(kind: Wire) -> dict[str, Any]:
    return read_back(kind).headers or {}


def test_a_table_nested_3000_deep_is_poison_headers_too_deep() -> None:
    parser = EnvelopeParser(EnvelopeLimits())

    with pytest.raises(Poison) as judged:
        parser.check_headers(headers_of(Wire.DEEP_HEADERS))

    assert judged.value.reason is PoisonReason.HEADERS_TOO_DEEP


def test_the_headers_made_safe_arrive_as_their_kind_says() -> None:
    # A producer's consumer-attempt of 5,000 digits is dropped on arrival
    digits = headers_of(Wire.LONG_ATTEMPT)
    assert len(digits["consumer-attempt"]) == hostile.ATTEMPT_DIGITS
    assert attempts_so_far(trusted_headers(digits, trusted=False)) == 0
    # A string that is not UTF-8 becomes text, a double past single precision its text
    assert "\ufffd" in headers_of(Wire.NOT_UTF8_HEADER)["note"]
    assert headers_of(Wire.HUGE_DOUBLE)["big"] == repr(hostile.HUGE)
    # Forged service headers are the producer's, dropped on arrival
    forged = headers_of(Wire.FORGED)
    assert forged == hostile.FORGED
    assert trusted_headers(forged, trusted=False) == {}
    # None of them is poison
    for kind in (*hostile.SAFE_ONCE_READ, Wire.FORGED):
        EnvelopeParser(EnvelopeLimits()).check_headers(headers_of(kind))


def test_a_message_id_that_is_not_utf8_reads_back_as_the_id_sent() -> None:
    received = read_back(Wire.NOT_UTF8_MESSAGE_ID).message_id

    assert received == "k000001.0~1" + hostile.READ_TAIL
    assert hostile.sent_id(received) == "k000001.0~1"
    assert read_back(Wire.LONG_ATTEMPT).message_id == "k000001.0~1"
