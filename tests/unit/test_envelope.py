import json
import uuid
from datetime import UTC, datetime, timedelta

import pytest

from consumer.errors import Poison, PoisonReason
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser, check_content_type

LIMIT = 4096
PARSER = EnvelopeParser(EnvelopeLimits(max_bytes=LIMIT, max_depth=8))


def body(**overrides: object) -> bytes:
    envelope: dict[str, object] = {
        "event_id": str(uuid.uuid4()),
        "type": "inventory.reserve",
        "occurred_at": "2026-11-29T10:00:00+01:00",
        "payload": {"sku": "A"},
    }
    envelope.update(overrides)
    return json.dumps({k: v for k, v in envelope.items() if v is not None}).encode()


def reason_for(data: bytes) -> PoisonReason:
    with pytest.raises(Poison) as caught:
        PARSER.parse(data)
    return caught.value.reason


def test_parses_a_valid_envelope_from_bytes() -> None:
    event_id = uuid.uuid4()
    parsed = PARSER.parse(body(event_id=str(event_id), correlation_id="c-1"))
    assert parsed.event_id == event_id
    assert parsed.type == "inventory.reserve"
    assert parsed.occurred_at.utcoffset() is not None
    assert parsed.payload == {"sku": "A"}
    assert parsed.correlation_id == "c-1"


@pytest.mark.parametrize(
    ("data", "reason"),
    [
        (b"not json", PoisonReason.NOT_JSON),
        (b"", PoisonReason.NOT_JSON),
        (b'{"event_id": "\xff\xfe"}', PoisonReason.NOT_UTF8),
        (b"[1, 2]", PoisonReason.INVALID_ENVELOPE),
        (b"null", PoisonReason.INVALID_ENVELOPE),
        (body(event_id="not-a-uuid"), PoisonReason.INVALID_ENVELOPE),
        (body(occurred_at="2026-11-29T10:00:00"), PoisonReason.INVALID_ENVELOPE),
        (body(type=""), PoisonReason.INVALID_ENVELOPE),
        (body(type="has space"), PoisonReason.INVALID_ENVELOPE),
        (body(payload=[1]), PoisonReason.INVALID_ENVELOPE),
        (body(extra_field=1), PoisonReason.INVALID_ENVELOPE),
        (body(payload="x" * LIMIT), PoisonReason.BODY_TOO_LARGE),
        (body(occurred_at=1_700_000_000), PoisonReason.INVALID_ENVELOPE),
        (body(occurred_at="2999-01-01T00:00:00Z"), PoisonReason.INVALID_ENVELOPE),
        (b'{"event_id": 1, "event_id": 2}', PoisonReason.DUPLICATE_KEY),
        (body(payload={"a": 1}).replace(b'"a": 1', b'"a": 1, "a": 2'), PoisonReason.DUPLICATE_KEY),
        (body(payload={"n": float("nan")}), PoisonReason.NOT_JSON),
        (b"\xef\xbb\xbf" + body(), PoisonReason.NOT_JSON),
        (body(payload={"a": [[[[[[[[[1]]]]]]]]]}), PoisonReason.TOO_DEEP),
        (b"[" * 100_000 + b"]" * 100_000, PoisonReason.BODY_TOO_LARGE),
        (('{"a": ' * 3000 + "1" + "}" * 3000).encode(), PoisonReason.BODY_TOO_LARGE),
    ],
)
def test_every_bad_body_is_poison_with_its_reason(data: bytes, reason: PoisonReason) -> None:
    assert reason_for(data) is reason


NOT_FINITE = [b"1e309", b"-1e309", b"1.8e308", b"123456789e999", b"Infinity", b"-Infinity", b"NaN"]


@pytest.mark.parametrize("literal", NOT_FINITE)
def test_a_number_that_is_no_finite_double_is_poison(literal: bytes) -> None:
    # float() reads 1e309 as infinity: the payload's handler would meet it, not the parser
    data = body(payload={"price": 1.5}).replace(b"1.5", literal)

    with pytest.raises(Poison) as caught:
        PARSER.parse(data)

    assert caught.value.reason is PoisonReason.NOT_JSON
    assert literal.decode().lstrip("-")[:8] in caught.value.detail


@pytest.mark.parametrize("literal", [b"1.7976931348623157e308", b"-2.5e-324", b"1e-400", b"7"])
def test_a_number_within_the_double_range_is_kept(literal: bytes) -> None:
    parsed = PARSER.parse(body(payload={"price": 1.5}).replace(b"1.5", literal))

    assert parsed.payload["price"] == float(literal)


def test_a_missing_field_is_named_in_the_detail() -> None:
    with pytest.raises(Poison) as caught:
        PARSER.parse(body(event_id=None))
    assert "event_id" in caught.value.detail


@pytest.mark.parametrize(
    ("content_type", "encoding"),
    [(None, None), ("application/json", None), ("application/json; charset=utf-8", "identity")],
)
def test_json_content_types_are_accepted(content_type: str | None, encoding: str | None) -> None:
    check_content_type(content_type, encoding)


@pytest.mark.parametrize(
    ("content_type", "encoding"),
    [("text/plain", None), ("application/json; charset=latin-1", None), (None, "gzip")],
)
def test_other_content_types_are_poison(content_type: str | None, encoding: str | None) -> None:
    with pytest.raises(Poison) as caught:
        check_content_type(content_type, encoding)
    assert caught.value.reason is PoisonReason.WRONG_CONTENT_TYPE


BIG = EnvelopeParser(EnvelopeLimits(max_bytes=10_000_000, max_depth=32, max_containers=10**7))


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 200_000 + b"]" * 200_000,
        ('{"a": ' * 50_000 + "1" + "}" * 50_000).encode(),
        body(payload={"deep": json.loads("[" * 40 + "]" * 40)}),
    ],
)
def test_deep_nesting_is_poison_not_a_crash(data: bytes) -> None:
    with pytest.raises(Poison) as caught:
        BIG.parse(data)
    assert caught.value.reason is PoisonReason.TOO_DEEP


def test_extra_top_level_fields_only_when_allowed() -> None:
    data = body(producer="svc-a")
    assert reason_for(data) is PoisonReason.INVALID_ENVELOPE
    lenient = EnvelopeParser(EnvelopeLimits(allow_extra_fields=True))
    assert lenient.parse(data).type == "inventory.reserve"


def test_occurred_at_may_run_a_little_ahead_of_our_clock() -> None:
    now = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)
    parser = EnvelopeParser(EnvelopeLimits(max_future_skew=timedelta(hours=1)))
    parser.parse(body(occurred_at=(now + timedelta(minutes=59)).isoformat()), now=now)
    with pytest.raises(Poison, match="in the future"):
        parser.parse(body(occurred_at=(now + timedelta(minutes=61)).isoformat()), now=now)


def test_oversized_headers_are_poison() -> None:
    parser = EnvelopeParser(EnvelopeLimits(max_header_bytes=1024))
    parser.check_headers({"consumer-attempt": 2, "tenant": "acme", "x-death": [{"queue": "q"}]})
    with pytest.raises(Poison) as caught:
        parser.check_headers({"blob": "x" * 2000})
    assert caught.value.reason is PoisonReason.HEADERS_TOO_LARGE
    with pytest.raises(Poison):
        parser.check_headers({f"h{n}": [{"k": "v" * 10}] * 10 for n in range(20)})


def test_a_body_of_too_many_containers_is_poison_before_it_is_parsed() -> None:
    parser = EnvelopeParser(EnvelopeLimits(max_bytes=2_000_000, max_containers=10_000))
    tiny_arrays = body(payload={"params": [[] for _ in range(340_000)]})
    with pytest.raises(Poison) as caught:
        parser.parse(tiny_arrays)
    assert caught.value.reason is PoisonReason.TOO_COMPLEX


def test_brackets_inside_strings_are_not_containers() -> None:
    parser = EnvelopeParser(EnvelopeLimits(max_containers=10))
    text = "[{" * 1000 + '\\"[' * 100
    parsed = parser.parse(body(payload={"text": text, "list": [1, [2]]}))
    assert parsed.payload["text"] == text
