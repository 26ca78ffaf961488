"""Found in the second review: a short string that is not UTF-8 decoded to text three times its
size, which no copy of the message could encode again (pamqp: TypeError, the worker died)."""

from __future__ import annotations

import pytest
from pamqp import decode, encode

from consumer.amqp import wire


@pytest.mark.parametrize(
    "raw",
    [b"\xff" * 100, b"\xff" * 255, b"a" * 200 + b"\xe2\x82" * 27 + b"\xff", "é".encode() * 127],
)
def test_every_short_string_decoded_can_be_encoded_again(raw: bytes) -> None:
    wire.install()
    consumed, text = decode.METHODS["shortstr"](bytes([len(raw)]) + raw)
    assert consumed == len(raw) + 1
    assert isinstance(text, str)
    assert encode.short_string(text)  # no TypeError: at most 255 bytes
    if raw.isascii() or raw == "é".encode() * 127:
        assert text == raw.decode()  # what is UTF-8 already is kept whole


def test_the_header_limit_counts_the_bytes_a_copy_carries() -> None:
    """Found in the second review: the limit counted characters, so 50,000 bytes that are not
    UTF-8 (150,000 bytes once decoded) passed it, and the copy of the failed event was too large
    for a frame: the broker closed the publishing connection, again at every redelivery."""
    from consumer.errors import Poison, PoisonReason
    from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser

    wire.install()
    raw = b"\xff" * 50_000
    _, text = decode.METHODS["longstr"](len(raw).to_bytes(4, "big") + raw)
    parser = EnvelopeParser(EnvelopeLimits())
    with pytest.raises(Poison) as poison:
        parser.check_headers({"note": text})
    assert poison.value.reason is PoisonReason.HEADERS_TOO_LARGE
    parser.check_headers({"note": "x" * 60_000})  # ASCII under the limit is fine


def test_the_message_of_an_error_whose_str_raises_says_so() -> None:
    from consumer.error_text import message_of

    class Unprintable(Exception):
        def __str__(self) -> str:
            raise AttributeError("code")

    message = message_of(Unprintable())
    assert message.startswith("<the message of ")
    assert message.endswith("Unprintable raised AttributeError>")
    assert message_of(ValueError("plain")) == "plain"
