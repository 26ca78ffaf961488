"""The service's database sessions against a link that goes silent mid-transaction.

A partition that drops packets (no RST), or a frozen process, looks the same to the server: a
client that stops talking. Its session, caught idle inside a transaction, would keep its row
locks (the event's receipt among them: a redelivered copy waits on it) until the system's TCP
keepalive gave up, two hours on Linux. The service's sessions open with
``idle_in_transaction_session_timeout`` and TCP keepalives of their own, so the server rolls the
orphan back and releases its locks; the redelivered copy then applies once.
"""

from __future__ import annotations

import signal
import uuid
from typing import Any

import asyncpg
from pydantic import BaseModel

from consumer import Envelope, register
from consumer.db.database import Database
from consumer.registry import HandlerRegistry
from consumer.service.components import database_config
from tests.support import ServiceProcess, TestEnv, behave, fetch, fetchval, wait_until

SESSION_SETTINGS = (
    "idle_in_transaction_session_timeout",
    "tcp_keepalives_idle",
    "tcp_keepalives_interval",
    "tcp_keepalives_count",
    "tcp_user_timeout",
    "application_name",
)

# An idle-in-transaction limit of 12s: three hard time limits, longer than twice the longest
# handler limit (the test handlers' own are at most 2s).
LIMITS = {"hard_timeout": "4s", "handler_timeout": "3s"}


async def test_the_services_sessions_end_idle_transactions_and_notice_a_silent_peer(
    env: TestEnv,
) -> None:
    settings = env.settings(**LIMITS)
    database = Database(database_config(settings, HandlerRegistry.from_modules(settings.handlers)))

    async with database:
        async with database.connection() as pooled:
            shown = {name: await pooled.fetchval(f"SHOW {name}") for name in SESSION_SETTINGS}
        own = await database.connect_one()  # the liveness lock's and the pruner's
        try:
            shown_own = {name: await own.fetchval(f"SHOW {name}") for name in SESSION_SETTINGS}
        finally:
            await own.close()

    expected = {
        "idle_in_transaction_session_timeout": "12s",
        "tcp_keepalives_idle": "30",
        "tcp_keepalives_interval": "10",
        "tcp_keepalives_count": "3",
        "tcp_user_timeout": "60000",
        "application_name": settings.name,
    }
    assert shown == expected
    assert shown_own == expected


class Nothing(BaseModel):
    key: str


@register("test.sessions_patient", payload=Nothing, timeout="45s")
async def patient(event: Envelope[Nothing], conn: asyncpg.Connection[Any]) -> None:
    """A handler allowed 45s (it may await something else that long inside its transaction)."""


def test_a_handler_allowed_longer_than_the_hard_limit_gets_a_longer_idle_limit(
    env: TestEnv,
) -> None:
    settings = env.settings(**LIMITS)
    registry = HandlerRegistry.from_modules([*settings.handlers, __name__])
    config = database_config(settings, registry)

    assert config.idle_in_transaction_timeout == 90.0
    assert config.server_settings["idle_in_transaction_session_timeout"] == "90000"
    # A command's sessions (migrate, dlq, ...) keep the server's own limit
    assert "idle_in_transaction_session_timeout" not in database_config(settings).server_settings


async def test_a_service_frozen_mid_transaction_holds_its_locks_no_longer_than_the_limit(
    env: TestEnv,
) -> None:
    # Given a service whose handler awaits inside its transaction (the receipt inserted)
    await env.apply_topology()
    service = await ServiceProcess(env, **LIMITS).start().wait_ready()
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("frozen", sleep_s=2.5, sleep_calls=1))

    async def idle_in_transaction() -> list[int]:
        rows = await fetch(
            env.database_url,
            "SELECT pid FROM pg_stat_activity WHERE application_name = $1"
            " AND state = 'idle in transaction'",
            env.name,
        )
        return [row["pid"] for row in rows]

    async def caught() -> bool:
        return bool(await idle_in_transaction())

    await wait_until(caught, what="the handler's transaction idle on the server")
    # When the process stops talking (frozen: to the server, a silent partition)
    service.signal(signal.SIGSTOP)
    try:
        [orphan] = await idle_in_transaction()

        # Then the server ends that session by itself, and the receipt's lock goes with it
        async def ended() -> bool:
            alive = await fetchval(
                env.database_url, "SELECT count(*) FROM pg_stat_activity WHERE pid = $1", orphan
            )
            return int(alive) == 0

        await wait_until(ended, timeout=60, what="the server to end the idle transaction")
        held = await fetchval(
            env.database_url,
            "SELECT count(*) FROM pg_locks l JOIN pg_stat_activity a USING (pid)"
            " WHERE a.application_name = $1 AND l.granted AND l.locktype = 'transactionid'",
            env.name,
        )
        assert held == 0
    finally:
        service.signal(signal.SIGCONT)

    # And once it runs again, the event is applied exactly once
    async def applied() -> bool:
        return await _effects(env, event_id) == 1

    await wait_until(applied, what="the event applied after the freeze")
    await service.wait_idle()
    assert await _effects(env, event_id) == 1
    assert await service.stop() == 0


async def _effects(env: TestEnv, event_id: uuid.UUID) -> int:
    return int(
        await fetchval(
            env.database_url, "SELECT count(*) FROM test_effects WHERE event_id = $1", event_id
        )
    )
