"""The one-pass validation of a known event type judges exactly as the long way does."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta
from types import SimpleNamespace
from typing import Any, cast

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import RootModel

from consumer.config.settings import Settings
from consumer.db.retention import ReceiptWindow
from consumer.errors import Poison, PoisonReason
from consumer.handlers.inventory import Reserve
from consumer.pipeline import prepare
from consumer.pipeline.envelope_parser import EnvelopeLimits, EnvelopeParser
from consumer.pipeline.prepare import Preparer
from consumer.registry import HandlerRegistry
from consumer.service.components import envelope_limits
from tests.support import FakeDelivery

REGISTRY = HandlerRegistry.from_modules(
    ["consumer.handlers.inventory", "consumer.handlers.notifications"]
)


def _preparer(**overrides: Any) -> Preparer:
    configured = Settings.model_validate(overrides)
    return Preparer(REGISTRY, EnvelopeParser(envelope_limits(configured)))


def _prepare(preparer: Preparer, delivery: Any) -> tuple[Any, Any]:
    prepared = preparer.prepared(delivery)
    if isinstance(prepared, Poison):
        raise prepared
    return prepared.handler, prepared.event


FAST = _preparer()
LENIENT = _preparer(allow_extra_fields=True)

scalars = st.none() | st.booleans() | st.integers(-5, 2_000_000) | st.text(max_size=70)
fields = st.dictionaries(
    st.sampled_from(["sku", "qty", "order_id", "recipient", "template", "params", "other"]),
    scalars | st.dictionaries(st.text(max_size=5), scalars, max_size=2),
    max_size=5,
)
# Mostly payloads that one of the handlers accepts, so that both ways often succeed.
payloads = st.one_of(
    st.fixed_dictionaries(
        {"sku": st.text(min_size=1, max_size=64), "qty": st.integers(1, 1_000_000)},
        optional={"order_id": st.text(min_size=1, max_size=64)},
    ),
    st.fixed_dictionaries(
        {"recipient": st.text(min_size=1, max_size=20), "template": st.text(max_size=5)},
        optional={"params": st.dictionaries(st.text(max_size=5), scalars, max_size=2)},
    ),
    fields,
    st.lists(scalars, max_size=2),
)
envelopes = st.fixed_dictionaries(
    {
        "event_id": st.one_of(st.uuids().map(str), st.uuids().map(str), st.just("not-a-uuid")),
        "type": st.one_of(st.sampled_from(list(REGISTRY)), st.sampled_from(["no.such", 42])),
        "occurred_at": st.one_of(
            st.just("2026-11-29T10:00:00+00:00"),
            st.sampled_from(["2026-11-29T10:00:00", "2999-01-01T00:00:00Z", 5]),
        ),
        "payload": payloads,
    },
    optional={"correlation_id": st.text(max_size=5), "extra": st.integers()},
)
# Envelopes whose every other field is right: the payload decides.
sound_envelopes = st.fixed_dictionaries(
    {
        "event_id": st.uuids().map(str),
        "type": st.sampled_from(list(REGISTRY)),
        "occurred_at": st.just("2026-11-29T10:00:00+00:00"),
        "payload": payloads,
    }
)


def _long_way(preparer: Preparer, body: bytes) -> Any:
    parser = EnvelopeParser(preparer._parser.limits)
    return REGISTRY.resolve(parser.parse(body))


def _judge(action: Any) -> tuple[str, Any]:
    try:
        handler, event = action()
    except Poison as poison:
        return ("poison", poison.reason)
    return (handler.event_type, event.model_dump())


@settings(max_examples=1500, suppress_health_check=[HealthCheck.too_slow])
@given(envelopes | sound_envelopes, st.booleans())
def test_prepare_agrees_with_parse_then_resolve(envelope: dict[str, Any], lenient: bool) -> None:
    preparer = LENIENT if lenient else FAST
    body = json.dumps(envelope).encode()
    delivery = FakeDelivery(
        content_type="application/json",
        content_encoding=None,
        headers={},
        body=body,
        body_discarded=False,
        message_id=None,
        routing_key=str(envelope["type"]),
    )
    fast = _judge(lambda: _prepare(preparer, delivery))
    slow = _judge(lambda: _long_way(preparer, body))
    assert fast == slow


def test_a_valid_reserve_takes_the_one_pass_model() -> None:
    body = json.dumps(
        {
            "event_id": str(uuid.uuid4()),
            "type": "inventory.reserve",
            "occurred_at": "2026-11-29T10:00:00Z",
            "payload": {"order_id": "o-1", "sku": "A", "qty": 2},
        }
    ).encode()
    delivery = FakeDelivery(
        content_type=None,
        content_encoding=None,
        headers={},
        body=body,
        body_discarded=False,
        message_id=None,
        routing_key="inventory.reserve",
    )
    handler, event = _prepare(FAST, delivery)
    assert handler.event_type == "inventory.reserve"
    assert type(event).__name__ == "Envelope[Reserve]"
    assert event.payload.qty == 2


def _delivery(envelope: dict[str, Any], routing_key: str) -> Any:
    """A delivery of ``envelope``'s JSON under ``routing_key``, as the preparer reads one."""
    return FakeDelivery(
        content_type=None,
        content_encoding=None,
        headers={},
        body=json.dumps(envelope).encode(),
        prepared=None,
        body_discarded=False,
        message_id=None,
        routing_key=routing_key,
    )


def _restock_under(routing_key: str, event_type: object = "inventory.restock") -> Any:
    envelope = {
        "event_id": str(uuid.uuid4()),
        "type": event_type,
        "occurred_at": datetime.now(UTC).isoformat(),
        "payload": {"sku": "A", "qty": 500},
    }
    return _delivery(envelope, routing_key)


def test_a_type_published_under_another_routing_key_is_poison_on_both_paths() -> None:
    # Given a restock published under the routing key of a type its producer may publish
    delivery = cast(Any, _restock_under("notification.requested"))

    # Then it is poison, in a batch and applied isolated (before its mark is even taken)
    prepared = FAST.prepared(delivery)
    isolated = FAST.identified(delivery)
    for verdict in (prepared, isolated):
        assert isinstance(verdict, Poison)
        assert verdict.reason is PoisonReason.ROUTING_KEY_MISMATCH
        assert "'inventory.restock'" in verdict.detail
        assert "'notification.requested'" in verdict.detail
    # And under its own routing key it is an event
    assert not isinstance(FAST.prepared(cast(Any, _restock_under("inventory.restock"))), Poison)


def test_a_type_that_is_not_text_stays_an_invalid_envelope() -> None:
    prepared = FAST.prepared(cast(Any, _restock_under("inventory.restock", event_type=42)))

    assert isinstance(prepared, Poison)
    assert prepared.reason is PoisonReason.INVALID_ENVELOPE


def test_a_root_model_payload_is_left_to_the_long_way() -> None:
    parser = EnvelopeParser(EnvelopeLimits())
    # The envelope requires an object payload; a RootModel need not be one.
    assert parser.typed(RootModel[list[int]]) is None
    assert parser.typed(dict[str, int]) is None
    assert parser.typed(Reserve) is not None


# One clock reading for the skew and age checks (the one-pass path): the edges judge as the
# receipt window and the skew limit say, with the clock frozen at NOW.
NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
WINDOW = ReceiptWindow(
    retention=timedelta(days=7),
    margin=timedelta(days=1),
    partition=timedelta(days=1),
    prune_interval=timedelta(hours=1),
)


class _Frozen(datetime):
    @classmethod
    def now(cls, tz: Any = None) -> _Frozen:
        return cls.fromtimestamp(NOW.timestamp(), tz)


def _reserve_at(occurred_at: datetime) -> Any:
    envelope = {
        "event_id": str(uuid.uuid4()),
        "type": "inventory.reserve",
        "occurred_at": occurred_at.isoformat(),
        "payload": {"order_id": "o-1", "sku": "A", "qty": 2},
    }
    return _delivery(envelope, "inventory.reserve")


@pytest.mark.parametrize(
    "offset",
    [
        -WINDOW.max_age - timedelta(milliseconds=1),
        -WINDOW.max_age - timedelta(microseconds=1),
        -WINDOW.max_age,
        -WINDOW.max_age + timedelta(microseconds=1),
        timedelta(0),
        timedelta(minutes=5),
        timedelta(minutes=5, microseconds=1),
        timedelta(minutes=5, milliseconds=1),
    ],
)
def test_the_age_and_skew_edges_judge_as_the_window_and_the_limit(
    monkeypatch: pytest.MonkeyPatch, offset: timedelta
) -> None:
    monkeypatch.setattr(prepare, "time", SimpleNamespace(time=NOW.timestamp))
    monkeypatch.setattr(prepare, "datetime", _Frozen)
    configured = Settings.model_validate({"max_future_skew": "5m"})
    preparer = Preparer(REGISTRY, EnvelopeParser(envelope_limits(configured)), window=WINDOW)
    occurred_at = NOW + offset

    prepared = preparer.prepared(cast(Any, _reserve_at(occurred_at)))

    expired = WINDOW.expired(occurred_at, NOW)
    ahead = occurred_at - NOW > timedelta(minutes=5)
    if expired:
        assert isinstance(prepared, Poison)
        assert prepared.reason is PoisonReason.EXPIRED
    elif ahead:
        assert isinstance(prepared, Poison)
        assert prepared.reason is PoisonReason.INVALID_ENVELOPE
    else:
        assert not isinstance(prepared, Poison), prepared


class _CountingParser(EnvelopeParser):
    decoded = 0

    def decode(self, body: bytes) -> dict[str, Any]:
        self.decoded += 1
        return super().decode(body)


def _reserve() -> Any:
    envelope = {
        "event_id": str(uuid.uuid4()),
        "type": "inventory.reserve",
        "occurred_at": datetime.now(UTC).isoformat(),
        "payload": {"order_id": "o-1", "sku": "A", "qty": 2},
    }
    return _delivery(envelope, "inventory.reserve")


def test_an_isolated_delivery_is_decoded_once_from_its_envelope_to_its_handler() -> None:
    parser = _CountingParser(envelope_limits(Settings()))
    preparer = Preparer(REGISTRY, parser)
    delivery = _reserve()

    # The isolated path: which event it is (to mark it), then the handler's model.
    identified = preparer.identified(delivery)
    assert not isinstance(identified, Poison)
    prepared = preparer.prepared(delivery, identified)

    assert not isinstance(prepared, Poison)
    assert prepared.event.event_id == identified.envelope.event_id
    assert parser.decoded == 1


def test_the_preparer_keeps_a_delivery_prepared_until_told_to_forget_it() -> None:
    parser = _CountingParser(envelope_limits(Settings()))
    preparer = Preparer(REGISTRY, parser)
    delivery = _reserve()

    first = preparer.prepared(delivery)
    assert preparer.prepared(delivery) is first
    assert parser.decoded == 1

    preparer.forget(delivery)
    preparer.prepared(delivery)
    assert parser.decoded == 2
