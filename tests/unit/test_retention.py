"""The expiry rule: an event older than the retention less the margin is never applied."""

from __future__ import annotations

import json
import uuid
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from pydantic import ValidationError

from consumer.cli.dlq.letters import renewed
from consumer.config.settings import Settings
from consumer.db.retention import EXPIRED_CLASS, ReceiptWindow
from consumer.envelope import RawEnvelope
from consumer.errors import Poison, PoisonReason
from consumer.pipeline.envelope_parser import EnvelopeParser
from consumer.pipeline.prepare import Preparer
from consumer.registry import HandlerRegistry
from consumer.service.components import envelope_limits, receipt_window
from tests.support import FakeDelivery

NOW = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
WEEK = ReceiptWindow(
    retention=timedelta(days=7),
    margin=timedelta(hours=1),
    partition=timedelta(days=1),
    prune_interval=timedelta(minutes=10),
)


def _event(occurred_at: datetime) -> RawEnvelope:
    return RawEnvelope(
        event_id=uuid.uuid4(), type="inventory.reserve", occurred_at=occurred_at, payload={}
    )


def test_an_event_is_applied_up_to_the_retention_less_the_margin() -> None:
    limit = NOW - timedelta(days=7) + timedelta(hours=1)
    assert not WEEK.expired(limit, NOW)
    assert WEEK.expired(limit - timedelta(microseconds=1), NOW)
    assert not WEEK.expired(NOW + timedelta(hours=3), NOW)  # the future is the skew check's
    WEEK.check(_event(limit), NOW)


def test_an_expired_event_is_poison_that_names_its_class_and_the_settings() -> None:
    with pytest.raises(Poison) as caught:
        WEEK.check(_event(NOW - timedelta(days=6, hours=23, minutes=1)), NOW)
    assert caught.value.reason is PoisonReason.EXPIRED
    # A class makes the service publish it with its reason, rather than nack it.
    assert caught.value.error_class == EXPIRED_CLASS
    assert "CONSUMER_RECEIPT_RETENTION" in caught.value.detail


def test_partitions_reach_past_the_skew_and_the_next_prune() -> None:
    assert WEEK.ahead(timedelta(hours=24)) == timedelta(days=2, minutes=10)
    assert WEEK.late_after() == timedelta(days=8, minutes=20)


@pytest.mark.parametrize(
    ("margin", "partition"),
    [(timedelta(days=7), timedelta(days=1)), (timedelta(hours=1), timedelta(0))],
)
def test_a_window_that_cannot_work_is_refused(margin: timedelta, partition: timedelta) -> None:
    with pytest.raises(ValueError, match="must be"):
        ReceiptWindow(timedelta(days=7), margin, partition, timedelta(minutes=10))


@pytest.mark.parametrize(
    ("variables", "named"),
    [
        ({"receipt_retention": "1h", "receipt_margin": "1h"}, "receipt_margin"),
        (
            {"receipt_retention": "1h", "receipt_margin": "5m", "receipt_partition": "2h"},
            "receipt_partition",
        ),
        ({"receipt_partition": "1500ms"}, "receipt_partition"),
        ({"receipt_prune_interval": "0s"}, "receipt_prune_interval"),
        # The margin covers the clocks' difference: the skew allowed must be shorter
        ({"receipt_margin": "1m"}, "max_clock_skew"),
        ({"receipt_margin": "10s", "max_clock_skew": "10s"}, "max_clock_skew"),
    ],
)
def test_bad_retention_settings_stop_start_up(variables: dict[str, str], named: str) -> None:
    with pytest.raises(ValidationError) as caught:
        Settings.model_validate(variables)
    assert caught.value.errors()[0]["loc"] == (named,)


def test_the_settings_give_a_week_kept_an_hour_of_margin_hourly_partitions() -> None:
    window = receipt_window(Settings())
    assert window == replace(WEEK, partition=timedelta(hours=1))


def _delivery(occurred_at: datetime) -> Any:
    body = {
        "event_id": str(uuid.uuid4()),
        "type": "inventory.reserve",
        "occurred_at": occurred_at.isoformat(),
        "payload": {"order_id": "o-1", "sku": "SKU-1", "qty": 1},
    }
    return FakeDelivery(
        body=json.dumps(body).encode(),
        content_type="application/json",
        content_encoding=None,
        headers={},
        body_discarded=False,
        message_id=None,
        routing_key="inventory.reserve",
    )


def test_the_preparer_refuses_an_expired_event_before_binding_it_to_its_handler() -> None:
    registry = HandlerRegistry.from_modules(["consumer.handlers.inventory"])
    settings = Settings(
        receipt_retention=timedelta(hours=1),
        receipt_margin=timedelta(minutes=5),
        receipt_partition=timedelta(minutes=10),
    )
    preparer = Preparer(
        registry, EnvelopeParser(envelope_limits(settings)), window=receipt_window(settings)
    )
    now = datetime.now(UTC)
    expired = preparer.prepared(_delivery(now - timedelta(minutes=56)))
    assert isinstance(expired, Poison)
    assert expired.reason is PoisonReason.EXPIRED
    assert not isinstance(preparer.prepared(_delivery(now - timedelta(minutes=50))), Poison)
    # The envelope alone (an event redelivered after a crash) is judged the same way.
    envelope = preparer.identified(_delivery(now - timedelta(minutes=56)))
    assert isinstance(envelope, Poison)
    assert envelope.reason is PoisonReason.EXPIRED


def test_a_forced_replay_gets_a_new_occurred_at_and_keeps_the_rest() -> None:
    body = json.dumps(
        {
            "event_id": "7b0c1c8e-4a8f-4d57-9a53-3f1f2b0a9c11",
            "type": "inventory.reserve",
            "occurred_at": "2026-11-01T10:00:00+00:00",
            "payload": {"note": "é"},
        }
    ).encode()
    new_body, before = renewed(body, NOW)
    assert before == "2026-11-01T10:00:00+00:00"
    renewed_envelope = json.loads(new_body)
    assert renewed_envelope["occurred_at"] == NOW.isoformat()
    assert {**renewed_envelope, "occurred_at": before} == json.loads(body)


def test_pruning_is_not_late_for_a_wider_partition_kept_whole() -> None:
    # The migration's partitions are a day wide whatever the setting (an hour): the oldest is
    # rightly kept up to a day past the retention, which must not read as pruning behind.
    window = receipt_window(Settings())
    now = datetime(2026, 12, 1, 12, 0, tzinfo=UTC)
    day = timedelta(days=1)
    oldest_starts = datetime(2026, 11, 24, tzinfo=UTC)  # ends within the retention: kept
    assert oldest_starts + day > now - window.retention
    assert now - oldest_starts > window.late_after()  # by the setting alone: a false alarm
    assert now - oldest_starts <= window.late_after(widest=day)
    assert window.late_after(widest=timedelta(minutes=5)) == window.late_after()
