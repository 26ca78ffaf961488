"""Fixtures: real RabbitMQ and PostgreSQL, isolated per test by a name prefix and a database.

The broker and database come from ``CONSUMER_TEST_AMQP_URL`` and ``CONSUMER_TEST_ADMIN_DSN``
(defaults: the local services). If they are not there, the tests fail; they never skip.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import aio_pika
import asyncpg
import pytest

from consumer.migrations import migrate
from tests.servers import ThrowawayPostgres, ThrowawayRabbit, free_port
from tests.support import REPO, TestEnv
from tests.wheels import Installed, install_product

RUN_ID = uuid.uuid4().hex[:8]
_counter = iter(range(1, 1_000_000))


@pytest.fixture(scope="session")
def amqp_url() -> str:
    return os.environ.get("CONSUMER_TEST_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/")


@pytest.fixture(scope="session")
def admin_dsn() -> str:
    return os.environ.get(
        "CONSUMER_TEST_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
    )


def _dsn(admin_dsn: str, database: str) -> str:
    return admin_dsn.rsplit("/", 1)[0] + "/" + database


async def make_template(admin_dsn: str, name: str) -> None:
    """A migrated database (plus the test handlers' tables) to copy for each test."""
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}"')
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    conn = await asyncpg.connect(_dsn(admin_dsn, name))
    try:
        await migrate(conn)
        await conn.execute((REPO / "tests" / "handlers" / "schema.sql").read_text())
    finally:
        await conn.close()


async def drop_database(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture(scope="session")
async def template_database(admin_dsn: str, amqp_url: str) -> AsyncIterator[str]:
    connection = await aio_pika.connect(amqp_url)  # fail early and clearly without a broker
    await connection.close()
    name = f"ctest_{RUN_ID}_template"
    await make_template(admin_dsn, name)
    yield name
    await drop_database(admin_dsn, name)


async def clone_database(admin_dsn: str, template: str) -> str:
    name = f"ctest_{RUN_ID}_{next(_counter)}"
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}" TEMPLATE "{template}"')
    finally:
        await admin.close()
    return name


@pytest.fixture
async def env(
    template_database: str, admin_dsn: str, amqp_url: str, tmp_path: Path
) -> AsyncIterator[TestEnv]:
    """A fresh database, a unique name prefix and a free HTTP port; cleaned up afterwards."""
    database = await clone_database(admin_dsn, template_database)
    test_env = TestEnv(
        name=f"t{RUN_ID}{next(_counter)}",
        database_url=_dsn(admin_dsn, database),
        amqp_url=amqp_url,
        http_port=free_port(),
        log_dir=tmp_path,
    )
    yield test_env
    test_env.kill_processes()
    await test_env.cleanup_broker()
    await drop_database(admin_dsn, database)


@pytest.fixture(scope="session")
def installed_product(tmp_path_factory: pytest.TempPathFactory) -> Installed:
    """The service's and the example project's wheels, built and installed in a fresh virtualenv
    outside the source tree: once per run (about 20 seconds, most of it pip)."""
    return install_product(tmp_path_factory.mktemp("installed"))


@pytest.fixture
def rabbit() -> Iterator[ThrowawayRabbit]:
    """A RabbitMQ node of the test's own, to stop and restart freely."""
    node = ThrowawayRabbit()
    node.start()
    yield node
    node.destroy()


@pytest.fixture
def postgres() -> Iterator[ThrowawayPostgres]:
    """A PostgreSQL cluster of the test's own, to stop, restart or freeze freely."""
    cluster = ThrowawayPostgres()
    cluster.init()
    cluster.start()
    yield cluster
    cluster.destroy()
