"""consumer.testing, on handlers made to fail every way: the harness reports what the service
does, in process and on the broker alike."""

from __future__ import annotations

from typing import Any

import asyncpg
import pytest

from consumer.testing import (
    EventOutcome,
    Harness,
    Message,
    TemplateDatabase,
    event,
    fresh_database,
    harness,
)

HANDLERS = ["tests.handlers.kit"]


@pytest.fixture(scope="session")
def consumer_handlers() -> list[str]:
    return HANDLERS


def summary(outcomes: list[EventOutcome]) -> list[tuple[str, int | None, str | None, str | None]]:
    return [(o.kind.value, o.rung, o.reason, o.error_class) for o in outcomes]


async def count(harness: Harness, query: str) -> Any:
    conn = await asyncpg.connect(harness.database_url)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


async def scenario(running: Harness) -> list[tuple[str, int | None, str | None, str | None]]:
    """Every kind of outcome, from one handler and one batch handler."""
    ok = event("kit.one", {"key": "a"})
    outcomes = await running.send(
        ok,
        event("kit.one", {"key": "b", "fail": "transient"}),
        event("kit.one", {"key": "c", "fail": "permanent"}),
        event("kit.one", {"key": "d", "fail": "bug"}),
        event("kit.one", {"key": "e", "fail": "swallow"}),
        event("kit.one", {"key": "f", "fail": "slow"}),
        event("kit.many", {"key": "g"}),
        event("kit.many", {"key": "h", "fail": "permanent"}),
        event("kit.one", {"key": ""}),
        Message(b"[]", routing_key="kit.one"),
    )
    outcomes += await running.send(ok)
    outcomes += await running.redeliver()
    return summary(outcomes)


EXPECTED = [
    ("processed", None, None, None),
    ("retried", 0, None, "TransientError"),
    ("dead_lettered", None, "permanent_failure", "PermanentError"),
    ("dead_lettered", None, "permanent_failure", "ZeroDivisionError"),
    ("dead_lettered", None, "permanent_failure", "SwallowedDatabaseError"),
    ("retried", 0, None, "HandlerTimeout"),
    ("processed", None, None, None),
    ("dead_lettered", None, "permanent_failure", "PermanentError"),
    ("poison", None, "invalid_payload", None),
    ("poison", None, "invalid_envelope", None),
    ("duplicate", None, None, None),
    # the two retried copies come back, their attempt raised, and fail the same way again
    ("retried", 1, None, "TransientError"),
    ("retried", 1, None, "HandlerTimeout"),
]


@pytest.mark.parametrize("broker", [False, True], ids=["in-process", "broker"])
async def test_each_outcome_is_reported_as_the_service_settles_it(
    consumer_database: str, broker: bool
) -> None:
    async with harness(HANDLERS, consumer_database, broker=broker) as running:
        assert running.mode == ("broker" if broker else "in-process")

        outcomes = await scenario(running)

        assert outcomes == EXPECTED
        assert running.waiting == 2
        assert await count(running, "SELECT count(*) FROM kit_effects") == 2


async def test_the_plugin_fixture_gives_a_harness_on_the_tests_own_database(
    consumer_harness: Harness, consumer_database: str
) -> None:
    [outcome] = await consumer_harness.send(event("kit.one", {"key": "a"}))

    assert outcome.processed
    assert consumer_harness.database_url == consumer_database
    assert await count(consumer_harness, "SELECT count(*) FROM kit_effects") == 1


async def test_copies_of_the_template_are_separate_and_dropped() -> None:
    async with TemplateDatabase(HANDLERS) as template:
        async with template.copy() as first, template.copy() as second:
            assert first != second
            for url in (first, second):
                conn = await asyncpg.connect(url)
                try:
                    applied = await conn.fetchval(
                        "SELECT count(*) FROM consumer_migrations WHERE migration_set = $1",
                        "tests.handlers.kit_sql",
                    )
                finally:
                    await conn.close()
                assert applied == 1
        admin = await asyncpg.connect(template.admin_dsn)
        try:
            left = await admin.fetchval(
                "SELECT count(*) FROM pg_database WHERE datname IN ($1, $2)",
                first.rsplit("/", 1)[1],
                second.rsplit("/", 1)[1],
            )
        finally:
            await admin.close()
    assert left == 0


async def test_fresh_database_is_one_migrated_database() -> None:
    async with fresh_database(HANDLERS) as url, harness(HANDLERS, url) as running:
        [outcome] = await running.send(event("kit.many", {"key": "x"}))
    assert outcome.processed
