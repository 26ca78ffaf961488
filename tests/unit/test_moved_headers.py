"""The headers of a copy ``consumer topology migrate`` moves out of a work queue."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from consumer.amqp import headers as h
from consumer.cli.topology.migrate import moved_headers
from topology.names import Names

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
