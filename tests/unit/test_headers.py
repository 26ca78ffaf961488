from datetime import UTC, datetime

import pytest

from consumer.amqp import headers as h
from topology.names import RETRY_RUNG, SHARD, SHARD_KEY

NOW = datetime(2026, 11, 29, 10, 0, tzinfo=UTC)


@pytest.mark.parametrize(
    ("value", "attempts"),
    [(None, 0), (2, 2), ("3", 3), (b"4", 4), ("x", 0), (-5, 0), (True, 0), (10**9, h.MAX_ATTEMPT)],
)
def test_attempts_come_from_our_header_only(value: object, attempts: int) -> None:
    headers = {"x-death": [{"count": 7}], "x-delivery-count": 9}
    if value is not None:
        headers[h.ATTEMPT] = value
    assert h.attempts_so_far(headers) == attempts


def test_retry_headers_strip_broker_headers_and_record_the_failure() -> None:
    original = {
        "x-death": [{"queue": "svc.retry.1s"}],
        "x-first-death-reason": "expired",
        "x-delivery-count": 2,
        "tenant": "acme",
        h.FIRST_FAILURE_AT: "earlier",
    }
    copy = h.retry_headers(
        original,
        attempt=2,
        rung="5s",
        error_class="TransientError",
        error_message="line one\nline two " + "x" * 1000,
        original_exchange="events",
        original_routing_key="inventory.reserve",
        now=NOW,
    )
    assert not [key for key in copy if key.startswith("x-")]
    assert copy["tenant"] == "acme"
    assert copy[h.ATTEMPT] == 2
    assert copy[RETRY_RUNG] == "5s"
    assert copy[h.FIRST_FAILURE_AT] == "earlier"
    assert copy[h.LAST_FAILURE_AT] == NOW.isoformat()
    assert "\n" not in copy[h.ERROR_MESSAGE]
    assert len(copy[h.ERROR_MESSAGE]) <= h.ERROR_MESSAGE_LIMIT
    assert copy[h.ORIGINAL_ROUTING_KEY] == "inventory.reserve"


def test_dead_letter_headers_say_what_happened() -> None:
    copy = h.dead_letter_headers(
        {RETRY_RUNG: "1s", h.ATTEMPT: 3, "x-death": []},
        reason="retries_exhausted",
        attempts=3,
        error_class="TransientError",
        error_message="still down",
        original_exchange="events",
        original_routing_key="inventory.reserve",
        service="svc",
        now=NOW,
    )
    assert copy[h.REASON] == "retries_exhausted"
    assert copy[h.ATTEMPT] == 3
    assert copy[h.SERVICE] == "svc"
    assert copy[h.DEAD_LETTERED_AT] == NOW.isoformat()
    assert RETRY_RUNG not in copy
    assert "x-death" not in copy


def test_replay_resets_attempts_and_counts_replays() -> None:
    dead = {
        h.ATTEMPT: 3,
        h.REASON: "retries_exhausted",
        h.ERROR_CLASS: "TransientError",
        "x-death": [],
        "tenant": "acme",
    }
    once = h.replay_headers(dead)
    assert h.attempts_so_far(once) == 0
    assert h.REASON not in once
    assert "x-death" not in once
    assert once["tenant"] == "acme"
    assert once[h.REPLAYS] == 1
    assert h.replay_headers(once)[h.REPLAYS] == 2


def test_a_shards_delivery_carries_its_shard_into_its_retry_and_dead_letter_copies() -> None:
    # A producer's own shard header is dropped on arrival; the shard the service consumed the
    # event from takes its place, whatever a copy said, and the shard key is the producer's
    producer = {SHARD: "s9", SHARD_KEY: "SKU-7", h.ATTEMPT: 3}
    assert h.trusted_headers(producer, trusted=False) == {SHARD_KEY: "SKU-7"}
    arrived = h.trusted_headers(producer, trusted=False, shard="s2")
    assert arrived == {SHARD_KEY: "SKU-7", SHARD: "s2"}
    assert h.trusted_headers({SHARD: "s1"}, trusted=True, shard="s3")[SHARD] == "s3"
    assert h.trusted_headers(None, trusted=False, shard="s1") == {SHARD: "s1"}

    retry = h.retry_headers(
        arrived,
        attempt=1,
        rung="1s",
        error_class="TransientError",
        error_message="later",
        original_exchange="events",
        original_routing_key="inventory.reserve",
        now=NOW,
    )
    assert (retry[SHARD], retry[SHARD_KEY]) == ("s2", "SKU-7")
    dead = h.dead_letter_headers(
        arrived,
        reason="permanent_failure",
        attempts=0,
        error_class="PermanentError",
        error_message="never",
        original_exchange="events",
        original_routing_key="inventory.reserve",
        service="svc",
        now=NOW,
    )
    assert dead[SHARD] == "s2"
