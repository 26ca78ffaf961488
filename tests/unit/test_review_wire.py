"""Found in review, now a regression test. The defect was: an undecodable top-level header table is
not poison for a producer's message.

``consumer.amqp.wire._headers_table`` replaces a table it cannot decode with
``{"consumer-unreadable-headers": UnreadableHeader(...)}``;
``consumer.amqp.headers.trusted_headers`` then drops every ``consumer-*`` key of a message that did
not come from the service's own exchange, so ``EnvelopeParser.check_headers`` never sees the marker:
the message is applied with its headers silently gone instead of being poison
(``headers_unreadable``) as wire.py says.
"""

from __future__ import annotations

import struct
from typing import Any

import pytest
from pamqp import decode

from consumer.amqp import wire
from consumer.amqp.headers import trusted_headers
from consumer.errors import Poison
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser


def test_an_unreadable_header_table_from_a_producer_is_poison() -> None:
    wire.install()
    entry = bytes([1]) + b"a" + b"Z" + b"xxxx"  # a field of an unknown type
    _, decoded = decode.METHODS["table"](struct.pack(">I", len(entry)) + entry)
    assert isinstance(decoded, dict)
    headers: dict[str, Any] = decoded
    parser = EnvelopeParser(EnvelopeLimits())
    with pytest.raises(Poison):
        parser.check_headers(headers)  # what wire.py intends
    # What the service actually checks: the producer's headers, consumer-* dropped. Expected
    # poison; today the marker is gone and nothing is raised.
    with pytest.raises(Poison):
        parser.check_headers(trusted_headers(headers, trusted=False))
