"""For any bytes the parser returns an envelope or a poison reason, never anything else."""

from __future__ import annotations

import json
import uuid

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.errors import Poison
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser

PARSER = EnvelopeParser(EnvelopeLimits(max_bytes=16 * 1024, max_depth=16))

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(), children, max_size=4)
    ),
    max_leaves=30,
)


def parse_or_poison(data: bytes) -> None:
    poison: Poison | None = None
    try:
        envelope = PARSER.parse(data)
    except Poison as caught:
        poison = caught
    if poison is not None:
        assert poison.reason.value
        assert len(poison.detail.splitlines()) <= 1, poison.detail
        return
    assert isinstance(envelope.event_id, uuid.UUID)
    assert envelope.occurred_at.utcoffset() is not None


@settings(max_examples=2000, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_any_bytes(data: bytes) -> None:
    parse_or_poison(data)


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_value(value: object) -> None:
    parse_or_poison(json.dumps(value).encode())


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.fixed_dictionaries(
        {
            "event_id": st.uuids().map(str) | st.text(max_size=40) | st.integers(),
            "type": st.from_regex(r"[a-z]{1,8}(\.[a-z]{1,8}){0,2}", fullmatch=True) | st.text(),
            "occurred_at": st.datetimes(timezones=st.timezones()).map(lambda d: d.isoformat())
            | st.text(max_size=30),
            "payload": st.dictionaries(st.text(max_size=8), json_values, max_size=4) | json_values,
        },
        optional={"correlation_id": st.text(max_size=300) | st.none(), "extra": json_values},
    )
)
def test_envelope_shaped_json(envelope: dict[str, object]) -> None:
    parse_or_poison(json.dumps(envelope).encode())


@settings(max_examples=500, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=64), st.integers(min_value=0, max_value=200))
def test_valid_envelopes_with_bytes_spliced_in(noise: bytes, at: int) -> None:
    valid = json.dumps(
        {
            "event_id": str(uuid.uuid4()),
            "type": "inventory.reserve",
            "occurred_at": "2026-11-29T10:00:00+00:00",
            "payload": {"sku": "A'; DROP TABLE stock; --", "qty": 1},
        }
    ).encode()
    parse_or_poison(valid[:at] + noise + valid[at:])
