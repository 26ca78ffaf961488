"""Fixtures: real RabbitMQ and PostgreSQL, isolated per test by a name prefix and a database.

The broker and database come from ``CONSUMER_TEST_AMQP_URL`` and ``CONSUMER_TEST_ADMIN_DSN``
(defaults: the local services). If they are not there, the tests fail; they never skip.

Every test that runs the service ends with the settlement invariant (``TestEnv.assert_settled``):
each service process still running and ready settled every delivery it received, none twice, and
the broker holds nothing unacked for the test. A test that ends with deliveries held on purpose
says so with ``@pytest.mark.holds_deliveries("why")``.

Each test publishes to an ingress exchange of its own (``<name>.events``, ``env.producer()``),
never the shared ``events``. Exactly once is counted, not inferred: no effect table has a unique
key on ``event_id`` in the tests' databases, so a second effect is a second row, and
``assert_applied_once`` checks every event has exactly one.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Generator, Iterator
from pathlib import Path

import aio_pika
import asyncpg
import pytest

from consumer.db.migrations import migrate
from tests.schedule import longest_first
from tests.servers import ThrowawayPostgres, ThrowawayRabbit, free_port
from tests.support import REPO, ServiceProcess, TestEnv, assert_services_settled, stop_cleanly
from tests.wheels import Installed, install_product

RUN_ID = uuid.uuid4().hex[:8]
_counter = iter(range(1, 1_000_000))
_CALL_PASSED = pytest.StashKey[bool]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "holds_deliveries(reason): the test ends with its service holding deliveries on purpose "
        "(paused, blocked): the settlement invariant does not wait for them to settle",
    )
    # The files run longest first in the order pytest_collection_modifyitems gives them
    # (tests/schedule.py), which pytest-xdist's loadfile would otherwise redo by test count.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    order = longest_first([item.nodeid for item in items])
    items[:] = [items[index] for index in order]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(
    item: pytest.Item, call: pytest.CallInfo[None]
) -> Generator[None, pytest.TestReport, None]:
    # Teardown checks run only after a passing test: a failed one has said what went wrong.
    outcome = yield
    report = outcome.get_result()
    if report.when == "call":
        item.stash[_CALL_PASSED] = report.passed


def _passed(request: pytest.FixtureRequest) -> bool:
    return bool(request.node.stash.get(_CALL_PASSED, False))


def _holds_deliveries(request: pytest.FixtureRequest) -> bool:
    return request.node.get_closest_marker("holds_deliveries") is not None


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
        # The reference tables lose their unique key on event_id, as test_effects has none: an
        # effect applied twice shows as a second row the tests count, instead of failing its
        # transaction and hiding as a dead letter. (No handler relies on the key.)
        await conn.execute(
            "ALTER TABLE stock_movements DROP CONSTRAINT stock_movements_event_id_key;"
            "CREATE INDEX stock_movements_event ON stock_movements (event_id);"
            "ALTER TABLE notifications DROP CONSTRAINT notifications_event_id_key;"
            "CREATE INDEX notifications_event ON notifications (event_id);"
        )
    finally:
        await conn.close()


async def drop_database(admin_dsn: str, name: str) -> None:
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
    finally:
        await admin.close()


@pytest.fixture
async def empty_database(admin_dsn: str) -> AsyncIterator[str]:
    """A database with nothing in it (not migrated), dropped afterwards."""
    name = f"ctest_migrate_{uuid.uuid4().hex[:10]}"
    admin = await asyncpg.connect(admin_dsn)
    await admin.execute(f'CREATE DATABASE "{name}"')
    await admin.close()
    yield admin_dsn.rsplit("/", 1)[0] + "/" + name
    await drop_database(admin_dsn, name)


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
    request: pytest.FixtureRequest,
    template_database: str,
    admin_dsn: str,
    amqp_url: str,
    tmp_path: Path,
) -> AsyncIterator[TestEnv]:
    """A fresh database, a unique name prefix (queues, exchanges, the ingress exchange too) and
    a free HTTP port; after a passing test, the settlement invariant; cleaned up afterwards."""
    database = await clone_database(admin_dsn, template_database)
    test_env = TestEnv(
        name=f"t{RUN_ID}{next(_counter)}",
        database_url=_dsn(admin_dsn, database),
        amqp_url=amqp_url,
        http_port=free_port(),
        log_dir=tmp_path,
    )
    yield test_env
    try:
        if _passed(request):
            await test_env.assert_settled(holds_deliveries=_holds_deliveries(request))
    finally:
        test_env.kill_processes()
        try:
            if _passed(request):
                await test_env.assert_nothing_held()
        finally:
            await test_env.cleanup_broker()
            await drop_database(admin_dsn, database)


@pytest.fixture(autouse=True)
async def _services_end_settled(request: pytest.FixtureRequest) -> AsyncIterator[None]:
    """Service processes a test started outside the ``env`` fixture (which checks and ends its
    own first): the same invariant for those still running, then they are ended."""
    first = len(ServiceProcess.started)
    yield
    left = [service for service in ServiceProcess.started[first:] if service.running]
    del ServiceProcess.started[first:]
    try:
        if _passed(request):
            holds = _holds_deliveries(request)
            checked = await assert_services_settled(left, holds_deliveries=holds)
            await stop_cleanly(checked)
    finally:
        for service in left:
            if service.running:
                service.kill()


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
