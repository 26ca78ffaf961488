"""The README's "Use it in your project", as a team would take it: the service's wheel and the
example project's (examples/) installed into a fresh virtualenv outside the source tree, then
``consumer`` migrates, applies the topology, runs the example's handlers, publishes and lists the
dead letters, and the example's rows appear. Once on a new database, once on one that already has
another tool's ``schema_migrations`` and a ``stock`` table of its own; and once with the example's
queue table (examples/queues.toml), every queue of it consuming and applying its events."""

from __future__ import annotations

import json
import platform
import uuid
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

import consumer
from consumer.config.queue_table import read_queue_table
from consumer.config.settings import DEFAULT_HANDLER_MODULES
from consumer.service.components import names_for
from tests.conftest import drop_database
from tests.support import (
    REPO,
    TestEnv,
    fetch,
    fetchval,
    queue_consumers,
    queue_depth,
    wait_until,
)
from tests.wheels import EXAMPLE, EXAMPLE_HANDLERS, Installed, InstalledService

# Another tool's ledger (golang-migrate's) and a table of the team's own with a reference name.
_THEIR_TABLES = """
CREATE TABLE schema_migrations (version bigint NOT NULL PRIMARY KEY, dirty boolean NOT NULL);
INSERT INTO schema_migrations VALUES (20250101120000, false);
CREATE TABLE stock (id serial PRIMARY KEY, warehouse text NOT NULL);
INSERT INTO stock (warehouse) VALUES ('north');
"""


APPLIED = [
    *(f"applied consumer.sql/{p.name}" for p in sorted((REPO / "sql").glob("*.sql"))),
    "applied billing.sql/001_charges_and_refunds.sql",
    "applied billing.sql/002_invoices.sql",
]
"""What ``consumer migrate`` applies on a new database: the service's set, then the example's."""


def _wheel_files(wheel: Path) -> set[str]:
    with zipfile.ZipFile(wheel) as archive:
        return {name for name in archive.namelist() if ".dist-info/" not in name}


def test_the_wheel_carries_every_module_and_every_migration(installed_product: Installed) -> None:
    files = _wheel_files(installed_product.service_wheel)

    sources = {
        path.relative_to(REPO).as_posix()
        for package in ("consumer", "topology")
        for path in (REPO / package).rglob("*")
        if path.suffix in (".py", ".sql", ".typed") and "__pycache__" not in path.parts
    }
    migrations = {f"consumer/sql/{path.name}" for path in (REPO / "sql").glob("*.sql")}
    assert files == sources | migrations
    assert "consumer/sql/001_receipts.sql" in files
    assert "consumer/handlers/sql/001_reference_tables.sql" in files
    with zipfile.ZipFile(installed_product.service_wheel) as archive:
        licenses = [name for name in archive.namelist() if name.endswith("/licenses/LICENSE")]
    assert licenses, "the LICENSE file is in the wheel's metadata"
    # consumer.testing's pytest plugin loads wherever the wheel is installed beside pytest
    with zipfile.ZipFile(installed_product.service_wheel) as archive:
        [entry_points] = [n for n in archive.namelist() if n.endswith("/entry_points.txt")]
        declared = archive.read(entry_points).decode()
    assert "[pytest11]\nconsumer = consumer.testing.plugin" in declared
    assert _wheel_files(installed_product.example_wheel) == {
        "billing/__init__.py",
        "billing/handlers.py",
        *(f"billing/sql/{p.name}" for p in (EXAMPLE / "billing" / "sql").glob("*.sql")),
    }


@pytest.fixture
async def team_database(admin_dsn: str) -> AsyncIterator[str]:
    """The name of a database ``consumer migrate --create-database`` may create; dropped after."""
    name = f"ctest_team_{uuid.uuid4().hex[:10]}"
    yield name
    await drop_database(admin_dsn, name)


@pytest.mark.parametrize("database", ["new", "with another tool's schema_migrations and stock"])
async def test_a_team_runs_its_own_handlers_from_the_installed_wheels(
    env: TestEnv, installed_product: Installed, admin_dsn: str, team_database: str, database: str
) -> None:
    product = installed_product
    dsn = admin_dsn.rsplit("/", 1)[0] + "/" + team_database
    if database != "new":
        admin = await asyncpg.connect(admin_dsn)
        await admin.execute(f'CREATE DATABASE "{team_database}"')
        await admin.close()
        conn = await asyncpg.connect(dsn)
        await conn.execute(_THEIR_TABLES)
        await conn.close()

    environment = env.env(database_url=dsn, handlers=EXAMPLE_HANDLERS)

    def consumer_command(*argv: str) -> str:
        result = product.run("consumer", *argv, env=environment)
        assert result.returncode == 0, f"consumer {' '.join(argv)}: {result.stderr}"
        assert "Traceback" not in result.stderr
        return result.stdout

    # Given the installed commands, which run the installed code and not this tree's
    assert consumer_command("--version") == f"rabbit-pg-consumer {consumer.__version__}\n"
    where = product.run(
        "python", "-c", "import consumer, billing; print(consumer.__file__, billing.__file__)",
        env=environment,
    )  # fmt: skip
    for module_file in where.stdout.split():
        assert Path(module_file).is_relative_to(product.venv), where.stdout
    assert "PYTHONPATH" not in product.environment(environment)

    # When the team migrates, declares the topology and runs its handlers
    migrated = consumer_command("migrate", "--create-database").splitlines()
    assert [line for line in migrated if line.startswith("applied ")] == APPLIED
    assert consumer_command("topology", "apply").endswith(" bindings\n")
    # (the queues and exchanges do not depend on the handlers: cleaned up with the env's)
    env.topologies.append(env.topology(handlers=",".join(DEFAULT_HANDLER_MODULES)))
    service = InstalledService(env, product, database_url=dsn, handlers=EXAMPLE_HANDLERS)
    await service.start().wait_ready()
    build = {"version": consumer.__version__, "python": platform.python_version()}
    assert await service.metric("consumer_build_info", **build) == 1

    # and publishes two charges, then (no order between events is promised) a refund that
    # fits and one that does not
    def publish(event_type: str, payload: dict[str, object]) -> str:
        argv = ("publish", "--type", event_type, "--payload", json.dumps(payload))
        return consumer_command(*argv).strip()

    publish("billing.charge", {"order_id": "o-1", "cents": 1250})
    publish("billing.charge", {"order_id": "o-2", "cents": 800, "currency": "USD"})

    async def charged() -> bool:
        return bool(await fetchval(dsn, "SELECT count(*) FROM charges") == 2)

    await wait_until(charged, what="the two charges")
    publish("billing.refund", {"order_id": "o-1", "cents": 250})
    too_much = publish("billing.refund", {"order_id": "o-2", "cents": 9999})

    # Then the example's rows appear, and the refund too large is a dead letter
    async def refunded() -> bool:
        return (
            await fetchval(dsn, "SELECT count(*) FROM refunds") == 1
            and await queue_depth(env.amqp_url, env.names.dead) == 1
        )

    await wait_until(refunded, what="one refund and one dead letter")
    charges = await fetch(dsn, "SELECT order_id, cents, currency FROM charges ORDER BY order_id")
    assert [tuple(row) for row in charges] == [("o-1", 1250, "EUR"), ("o-2", 800, "USD")]
    listed = consumer_command("dlq", "list", "--json").splitlines()
    (dead,) = [json.loads(line) for line in listed]
    assert dead["id"] == too_much
    assert dead["reason"] == "permanent_failure"
    assert "refund of 9999 > 800" in dead["error"]
    # Without CONSUMER_MANAGEMENT_URL the bindings are not compared, and it says so
    assert consumer_command("topology", "check") == (
        "topology is in place: exchanges and queues (set CONSUMER_MANAGEMENT_URL to compare the "
        "bindings too)\n"
    )
    assert await service.stop() == 0

    # And the service's ledger names its own sets; nothing of the reference handlers was made
    ledger = await fetch(dsn, "SELECT DISTINCT migration_set FROM consumer_migrations ORDER BY 1")
    assert [row[0] for row in ledger] == ["billing.sql", "consumer.sql"]
    assert await fetchval(dsn, "SELECT to_regclass('stock_movements')") is None
    if database != "new":
        # and the other tool's ledger and the team's stock table are as they were
        assert [tuple(r) for r in await fetch(dsn, "TABLE schema_migrations")] == [
            (20250101120000, False)
        ]
        assert [tuple(r) for r in await fetch(dsn, "TABLE stock")] == [(1, "north")]


def test_python_m_consumer_and_python_m_topology_work_from_the_installed_package(
    env: TestEnv, installed_product: Installed
) -> None:
    environment = env.env(handlers=EXAMPLE_HANDLERS)

    version = installed_product.run("python", "-m", "consumer", "--version", env=environment)
    plan = installed_product.run("python", "-m", "topology", "apply", "--dry-run", env=environment)

    assert version.stdout == f"rabbit-pg-consumer {consumer.__version__}\n"
    assert plan.returncode == 0, plan.stderr
    ingress = env.settings().exchange
    assert f"bind {ingress} -> {env.names.work} with routing key 'billing.charge'" in plan.stdout


async def test_a_team_runs_the_example_queue_table_from_the_installed_wheels(
    env: TestEnv,
    installed_product: Installed,
    admin_dsn: str,
    team_database: str,
    tmp_path: Path,
) -> None:
    # Given the installed commands and the example's queue table, as the team keeps it beside
    # its deployment (the table is not in the wheel); the table's names are the test's own and
    # are removed with its topology
    product = installed_product
    dsn = admin_dsn.rsplit("/", 1)[0] + "/" + team_database
    table_file = env.use_queue_table((EXAMPLE / "queues.toml").read_text(), tmp_path)
    environment = env.env(database_url=dsn, handlers=EXAMPLE_HANDLERS)
    assert environment["CONSUMER_QUEUES_FILE"] == str(table_file)
    table = read_queue_table(table_file, env.settings())
    assert len(table.names) >= 3
    work_queues = {queue: names_for(env.settings(), queue).work for queue in table.names}

    def consumer_command(*argv: str) -> str:
        result = product.run("consumer", *argv, env=environment)
        assert result.returncode == 0, f"consumer {' '.join(argv)}: {result.stderr}"
        assert "Traceback" not in result.stderr
        return result.stdout

    # When the team migrates, declares every queue's part and runs the whole table in one process
    migrated = consumer_command("migrate", "--create-database").splitlines()
    assert [line for line in migrated if line.startswith("applied ")] == APPLIED
    consumer_command("topology", "apply")
    service = InstalledService(env, product, database_url=dsn, handlers=EXAMPLE_HANDLERS)
    await service.start().wait_ready()

    # Then every queue of the table is consuming: in /readyz, and on the broker
    status, body = await service.readyz()
    assert status == 200, body
    assert set(body["queues"]) == set(table.names)
    assert [q for q, state in body["queues"].items() if not state["consuming"]] == []
    for queue, work in work_queues.items():
        assert await queue_consumers(env.amqp_url, work) == 1, work
        assert await service.metric("consumer_consuming", queue=queue) == 1

    # And when an event of each queue is published (the refund once its charge is in; by the
    # test's producer: the test above publishes with the installed command), each is applied
    # through its own queue, and a refund too large is a dead letter of the refunds'
    async with env.producer() as producer:
        await producer.send("billing.charge", {"order_id": "o-1", "cents": 1250})
        await producer.send("billing.invoice", {"order_id": "o-1", "number": "INV-0001"})

        async def charged() -> bool:
            return bool(await fetchval(dsn, "SELECT count(*) FROM charges") == 1)

        await wait_until(charged, what="the charge")
        await producer.send("billing.refund", {"order_id": "o-1", "cents": 250})
        too_much = await producer.send("billing.refund", {"order_id": "o-1", "cents": 9999})
    refunds_dead = names_for(env.settings(), "refunds").dead

    async def applied() -> bool:
        return (
            await fetchval(dsn, "SELECT count(*) FROM refunds") == 1
            and await fetchval(dsn, "SELECT count(*) FROM invoices") == 1
            and await queue_depth(env.amqp_url, refunds_dead) == 1
        )

    await wait_until(applied, what="the refund, the invoice and the refunds' dead letter")
    processed = {
        queue: await service.metric(
            "consumer_messages_total", queue=queue, type=event_type, outcome="processed"
        )
        for queue, event_type in [
            ("charges", "billing.charge"),
            ("refunds", "billing.refund"),
            ("invoices", "billing.invoice"),
        ]
    }
    assert processed == {"charges": 1, "refunds": 1, "invoices": 1}
    (dead,) = [
        json.loads(line)
        for line in consumer_command("dlq", "--queue", "refunds", "list", "--json").splitlines()
    ]
    assert dead["id"] == str(too_much)
    assert dead["reason"] == "permanent_failure"
    for queue in set(table.names) - {"refunds"}:
        assert await queue_depth(env.amqp_url, names_for(env.settings(), queue).dead) == 0
    assert await service.stop() == 0
