import json
import uuid

import pytest

from consumer.envelope import Poison, PoisonReason, check_content_type, parse_envelope

LIMIT = 4096


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
        parse_envelope(data, max_bytes=LIMIT)
    return caught.value.reason


def test_parses_a_valid_envelope_from_bytes() -> None:
    event_id = uuid.uuid4()
    parsed = parse_envelope(body(event_id=str(event_id), correlation_id="c-1"), max_bytes=LIMIT)
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
    ],
)
def test_every_bad_body_is_poison_with_its_reason(data: bytes, reason: PoisonReason) -> None:
    assert reason_for(data) is reason


def test_a_missing_field_is_named_in_the_detail() -> None:
    with pytest.raises(Poison) as caught:
        parse_envelope(body(event_id=None), max_bytes=LIMIT)
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
