"""Credentials the servers start rejecting while the service runs (a rotated password): RabbitMQ's
rejection is waited out, PostgreSQL's stops the service with one line
(docs/operations/settings.md)."""

from __future__ import annotations

import dataclasses
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from typing import Any

import asyncpg
import pytest

from tests.conftest import make_template
from tests.servers import ThrowawayPostgres
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetchval,
    queue_depth,
    rabbitmqctl,
    wait_until,
)


@dataclass(frozen=True)
class RabbitUser:
    name: str
    password: str

    def url(self, password: str | None = None) -> str:
        return f"amqp://{self.name}:{password or self.password}@127.0.0.1:5672/"


@pytest.fixture
async def rabbit_user() -> AsyncIterator[RabbitUser]:
    """A RabbitMQ user of the test's own on the shared node, deleted after the test (and after
    the env fixture's checks, which need the service still connected: request it before env)."""
    user = RabbitUser(f"t-cred-{uuid.uuid4().hex[:10]}", secrets.token_urlsafe(16))
    await rabbitmqctl("add_user", user.name, input_text=f"{user.password}\n")
    yield user
    await rabbitmqctl("delete_user", user.name)


async def close_connections_of(user: str) -> int:
    """Close that user's connections only (close_all_connections would hit other tests)."""
    # Tab-separated: JSON would give the pid in a form close_connection does not take.
    listed = await rabbitmqctl("list_connections", "pid", "user", "--silent")
    rows = [line.split("\t") for line in listed.splitlines() if line.strip()]
    pids = [pid for pid, name in rows if name == user]
    for pid in pids:
        await rabbitmqctl("close_connection", pid, "the password was changed (a test)")
    return len(pids)


def rejections(service: ServiceProcess) -> list[dict[str, Any]]:
    return [
        line
        for line in service.log_lines()
        if line.get("level") in ("warning", "error")
        and "authentication failed" in str(line.get("error", ""))
    ]


async def test_a_rabbitmq_password_changed_while_running_is_waited_out(
    rabbit_user: RabbitUser, env: TestEnv
) -> None:
    # Given the service running as a user of its own, with the consumer's usual permissions
    name = re.escape(env.name)
    await rabbitmqctl(
        *("set_permissions", "-p", "/", rabbit_user.name),
        *("^$", f"^{name}\\.(retry|dlx)$", f"^{name}\\.work$"),
    )
    await env.apply_topology()
    service = await ServiceProcess(env, amqp_url=rabbit_user.url()).start().wait_ready()
    async with env.producer() as producer:
        before = await producer.send("test.behave", behave("before"))
    await wait_until(lambda: _effects_are(env, 1), what="the first event applied")

    # When the user's password is changed and its connections are closed
    changed = secrets.token_urlsafe(16)
    await rabbitmqctl("change_password", rabbit_user.name, input_text=f"{changed}\n")
    assert await close_connections_of(rabbit_user.name) >= 1
    async with env.producer() as producer:
        during = await producer.send("test.behave", behave("during"))

    # Then the service keeps running, not ready, and logs the rejection at every attempt
    async def rejected_three_times() -> bool:
        return len(rejections(service)) >= 3

    await wait_until(rejected_three_times, what="three rejected reconnects")
    assert service.returncode is None
    status, readiness = await service.readyz()
    assert status == 503
    assert readiness["broker_connected"] is False
    assert await service.metric("consumer_broker_connected") == 0
    assert await queue_depth(env.amqp_url, env.names.work) == 1  # the event waits for it

    # When the password is restored
    await rabbitmqctl("change_password", rabbit_user.name, input_text=f"{rabbit_user.password}\n")

    # Then it reconnects by itself and goes on: each event applied once
    await service.wait_ready(timeout=30)
    await wait_until(lambda: _effects_are(env, 2), what="the event sent meanwhile applied")
    await service.wait_idle()
    await assert_applied_once(env.database_url, [before, during])
    log = service.log_text()
    assert rabbit_user.password not in log
    assert changed not in log


_HBA = """\
local all all                   trust
host  all postgres 127.0.0.1/32 trust
host  all all      127.0.0.1/32 scram-sha-256
"""


@pytest.fixture
def password_postgres() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL cluster of the test's own that checks passwords (the shared one trusts
    everyone), its ``postgres`` trusted for the test's own reads."""
    cluster = ThrowawayPostgres(hba=_HBA)
    cluster.init()
    cluster.start()
    yield cluster
    cluster.destroy()


async def test_a_postgres_password_changed_while_running_stops_the_service_with_one_line(
    password_postgres: ThrowawayPostgres, env: TestEnv
) -> None:
    # Given the service running as a role of its own that logs in with a password
    cluster = password_postgres
    await make_template(cluster.admin_dsn, "consumer")
    admin_dsn = cluster.dsn("consumer")
    role, password = f"svc_{uuid.uuid4().hex[:10]}", secrets.token_urlsafe(16)
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f"CREATE ROLE {role} LOGIN PASSWORD '{password}'")
        await admin.execute(
            f"GRANT SELECT, INSERT, UPDATE ON ALL TABLES IN SCHEMA public TO {role}"
        )
        env = dataclasses.replace(
            env, database_url=f"postgresql://{role}:{password}@127.0.0.1:{cluster.port}/consumer"
        )
        await env.apply_topology()
        service = await ServiceProcess(env, db_pool_size="1").start().wait_ready()
        async with env.producer() as producer:
            before = await producer.send("inventory.restock", {"sku": "PW", "qty": 1})

        async def applied() -> bool:
            return int(await fetchval(admin_dsn, "SELECT count(*) FROM stock_movements")) == 1

        await wait_until(applied, what="the first event applied")

        # When the role's password changes and its sessions end, so the pool needs a new one
        changed = secrets.token_urlsafe(16)
        await admin.execute(f"ALTER ROLE {role} PASSWORD '{changed}'")
        await admin.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = $1", role
        )
        async with env.producer() as producer:
            after = await producer.send("inventory.restock", {"sku": "PW", "qty": 1})

        # Then the service stops, exit code 2, with one line that says why
        assert await service.wait_exit(timeout=30) == 2
        log = service.log_text()
        errors = [line for line in log.splitlines() if line.startswith("error: ")]
        assert len(errors) == 1, log[-3000:]
        assert "CONSUMER_DATABASE_URL" in errors[0]
        assert "password authentication failed" in errors[0]
        assert "Traceback" not in log
        assert password not in log
        assert changed not in log
        # And the event it could not apply waits in the work queue: not applied, not dead
        await assert_applied_once(admin_dsn, [before], "stock_movements")
        assert await queue_depth(env.amqp_url, env.names.dead) == 0

        async def back_in_the_queue() -> bool:
            return await queue_depth(env.amqp_url, env.names.work) == 1

        await wait_until(back_in_the_queue, what=f"{after} back in the work queue")
    finally:
        await admin.close()


async def _effects_are(env: TestEnv, expected: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) == expected
