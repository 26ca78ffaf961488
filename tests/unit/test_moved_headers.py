"""The headers of a copy ``consumer topology migrate`` moves out of a work queue."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from consumer.amqp import headers as h
from consumer.cli.topology.migrate import moved_headers
from topology.mover import _copy
from topology.names import SHARD, SHARD_KEY, Names
from topology.steps import Move

NAMES = Names("svc", "events")


def _message(exchange: str, headers: dict[str, Any]) -> Any:
    return SimpleNamespace(exchange=exchange, routing_key="test.behave", headers=headers)


def test_a_producers_own_headers_are_dropped_and_its_origin_recorded() -> None:
    rewrite = moved_headers(NAMES)

    copy = rewrite(_message("events", {h.ATTEMPT: 99, "trace": "t1", h.REPLAYS: 1}))

    # The copy goes through the service's trusted exchange: it must not carry a forged count.
    assert h.ATTEMPT not in copy
    assert copy["trace"] == "t1"
    assert copy[h.REPLAYS] == 1
    assert copy[h.ORIGINAL_EXCHANGE] == "events"
    assert copy[h.ORIGINAL_ROUTING_KEY] == "test.behave"


def test_a_retry_copys_headers_are_kept_as_the_service_wrote_them() -> None:
    rewrite = moved_headers(NAMES)
    written = {h.ATTEMPT: 2, h.ORIGINAL_EXCHANGE: "events", h.ORIGINAL_ROUTING_KEY: "x"}

    copy = rewrite(_message(NAMES.redeliver, written))

    assert copy == written


def _shard_message(exchange: str, headers: dict[str, Any]) -> Any:
    # what topology.mover._copy reads of a delivery
    return SimpleNamespace(
        exchange=exchange,
        routing_key="test.behave",
        headers=headers,
        body=b"{}",
        content_type="application/json",
        content_encoding=None,
        priority=None,
        correlation_id=None,
        reply_to=None,
        expiration=None,
        message_id="m1",
        timestamp=None,
        type=None,
        app_id=None,
    )


def test_a_leaving_shard_s_copy_carries_its_key_and_its_shard_s_label_for_the_redirect() -> None:
    # resharding to fewer shards: the copy goes through the redeliver exchange, whose binding on
    # the leaving shard's label sends it to the hash exchange, which hashes the key it kept
    sharded = Names("svc", "events", queue="q")
    step = Move("svc.q.work.s4", sharded.redeliver, None, from_work=True, shard="s4")
    producers = {SHARD_KEY: "SKU-7", SHARD: "s1", h.ATTEMPT: 5, "x-death": []}
    retried = {SHARD_KEY: "SKU-7", SHARD: "s4", h.ATTEMPT: 2}

    fresh = _copy(_shard_message("events", producers), step, None, moved_headers(sharded))
    again = _copy(_shard_message(sharded.redeliver, retried), step, None, moved_headers(sharded))

    assert fresh.headers is not None
    assert fresh.headers[SHARD_KEY] == "SKU-7"
    assert fresh.headers[SHARD] == "s4"
    assert h.ATTEMPT not in fresh.headers
    assert "x-death" not in fresh.headers
    # a retry's attempt count is the service's own: kept
    assert again.headers == {SHARD_KEY: "SKU-7", SHARD: "s4", h.ATTEMPT: 2}
