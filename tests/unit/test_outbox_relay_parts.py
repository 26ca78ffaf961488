"""The outbox relay's pure parts: which rows of a batch keep their key's order, how a batch is
published (chains side by side), its settings, and a round on a stand-in publisher."""

from __future__ import annotations

import io
import uuid
from datetime import timedelta
from typing import Any

import pytest
from pamqp.commands import Basic
from prometheus_client import CollectorRegistry

from consumer.amqp.publisher import PERSISTENT
from consumer.db.outbox_rows import OutboxRow, in_key_order
from consumer.errors import PublishFailed, Unroutable
from consumer.logs import make_logger
from consumer.observe.metrics import Metrics
from consumer.service.outbox_relay import (
    OutboxRelay,
    RelayConfig,
    RoundResult,
    _chains,
    _properties,
)
from tests.unit.test_settings import error_line, settings
from topology.names import SHARD_KEY


def row(id: int, key: str | None = None) -> OutboxRow:
    return OutboxRow(
        id=id,
        event_id=uuid.uuid4(),
        type="inventory.restock",
        order_key=key,
        body=b"{}",
        headers={},
        age=0.0,
    )


def ids(rows: list[OutboxRow]) -> list[int]:
    return [r.id for r in rows]


def test_a_batch_with_no_earlier_row_owed_elsewhere_is_kept_whole() -> None:
    batch = [row(1, "a"), row(2), row(3, "b"), row(4, "a")]
    assert ids(in_key_order(batch, {})) == [1, 2, 3, 4]


def test_a_key_whose_earlier_row_another_replica_holds_waits_and_the_others_go() -> None:
    # Row 2 (key a) is locked by another replica's round: rows 3 and 5 of key a wait for it.
    batch = [row(1, "b"), row(3, "a"), row(4), row(5, "a")]
    assert ids(in_key_order(batch, {"a": 2})) == [1, 4]


def test_a_key_s_rows_before_its_first_row_owed_elsewhere_go() -> None:
    # Rows 1 and 3 of key a are in the batch, row 4 is not (past the batch, or held elsewhere):
    # those before it go, row 6 after it waits.
    batch = [row(1, "a"), row(3, "a"), row(6, "a"), row(7)]
    assert ids(in_key_order(batch, {"a": 4})) == [1, 3, 7]


def test_rows_without_a_key_are_never_held() -> None:
    batch = [row(5), row(6)]
    assert ids(in_key_order(batch, {"a": 1})) == [5, 6]


def test_a_batch_is_one_chain_per_key_in_id_order_and_one_per_row_without_a_key() -> None:
    batch = [row(1, "a"), row(2), row(3, "b"), row(4, "a"), row(5), row(6, "b")]
    assert [ids(chain) for chain in _chains(batch)] == [[1, 4], [2], [3, 6], [5]]


def test_the_relay_settings_default_and_read(monkeypatch: pytest.MonkeyPatch) -> None:
    defaults = settings(monkeypatch)
    assert defaults.outbox_relay is True
    assert defaults.outbox_batch_size == 100
    assert defaults.outbox_poll == timedelta(seconds=5)
    values = settings(monkeypatch, outbox_relay="on", outbox_batch_size="7", outbox_poll="1m")
    assert values.outbox_relay is True
    assert values.outbox_batch_size == 7
    assert values.outbox_poll == timedelta(minutes=1)
    assert settings(monkeypatch, outbox_relay="off").outbox_relay is False


@pytest.mark.parametrize(
    ("env", "name"),
    [
        ({"outbox_relay": "sometimes"}, "CONSUMER_OUTBOX_RELAY"),
        ({"outbox_batch_size": "0"}, "CONSUMER_OUTBOX_BATCH_SIZE"),
        ({"outbox_poll": "0s"}, "CONSUMER_OUTBOX_POLL"),
        ({"outbox_poll": "soon"}, "CONSUMER_OUTBOX_POLL"),
    ],
)
def test_a_bad_relay_setting_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], name: str
) -> None:
    line = error_line(monkeypatch, **env)
    assert "\n" not in line
    assert line.startswith(f"invalid setting {name}")


class Broker:
    """A stand-in publisher: refuses the routing keys and event ids it is told to."""

    def __init__(self, *, unroutable: str = "", nack: set[uuid.UUID] | None = None) -> None:
        self.unroutable = unroutable
        self.nack = nack or set()
        self.published: list[str] = []

    async def publish(
        self, body: bytes, properties: Basic.Properties, *, exchange: str, routing_key: str
    ) -> None:
        if routing_key == self.unroutable:
            raise Unroutable(f"{exchange!r} could not route {routing_key!r}")
        if uuid.UUID(properties.message_id) in self.nack:
            raise PublishFailed("the broker refused the message")
        self.published.append(str(properties.message_id))


async def test_a_key_stops_at_a_transient_failure_and_unpublishable_rows_fail_for_good() -> None:
    a1, a2, b1 = row(1, "a"), row(2, "a"), row(3, "b")
    lost = OutboxRow(**{**_fields(row(4)), "type": "nobody.listens"})
    large = OutboxRow(**{**_fields(row(5, "b")), "body": b"x" * 65})
    broker = Broker(unroutable="nobody.listens", nack={a1.event_id})
    relay = OutboxRelay(
        RelayConfig(exchange="events", max_body_bytes=64),
        connect=_never,
        publisher=lambda: broker,
        logger=make_logger("test", log_format="console", stream=io.StringIO()),
        metrics=Metrics(CollectorRegistry(), []),
    )
    result = RoundResult()
    confirmed = await relay._publish_all(broker, [a1, a2, b1, lost, large], result)
    # a2 never overtakes a1, which failed: it waits for the next round.
    assert confirmed == [3]
    assert broker.published == [str(b1.event_id)]
    # the unroutable row and the one too large for the consumers fail for good
    assert {(r.id, r.permanent) for r in result.refused} == {(1, False), (4, True), (5, True)}
    assert result.again_soon


def _fields(r: OutboxRow) -> dict[str, Any]:
    return {name: getattr(r, name) for name in OutboxRow.__slots__}


async def _never() -> Any:
    raise AssertionError("no connection in a unit test")


def test_a_row_goes_out_as_consumer_publish_sends_an_event_with_its_key_as_shard_key() -> None:
    keyed, keyless = row(1, "sku-1"), OutboxRow(**{**_fields(row(2)), "headers": {"a": 1}})
    properties = _properties(keyed)
    assert properties.message_id == str(keyed.event_id)
    assert properties.delivery_mode == PERSISTENT
    assert properties.content_type == "application/json"
    assert properties.headers == {SHARD_KEY: "sku-1"}
    assert _properties(keyless).headers == {SHARD_KEY: str(keyless.event_id), "a": 1}
