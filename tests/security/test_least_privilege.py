"""The service under least-privileged accounts made by deploy/rabbitmq/users.sh and
deploy/postgres/roles.sql (run for real), and what a missing permission looks like."""

from __future__ import annotations

import json
import re
import secrets
from dataclasses import dataclass
from pathlib import Path

import aio_pika
import aiormq
import pytest

from consumer.registry import HandlerRegistry
from consumer.service.components import topology_for
from tests.security.support import (
    Broker,
    Cluster,
    admin_execute,
    apply_roles_sql,
    apply_users_sh,
    one_line_error,
    write_secret,
)
from tests.servers import free_port
from tests.support import (
    REPO,
    ServiceProcess,
    TestEnv,
    behave,
    fetchval,
    queue_depth,
    run_cli,
    wait_until,
)
from topology.apply import missing


@dataclass
class LockedDown:
    """One service's accounts: its own RabbitMQ users, its own database with the two roles."""

    name: str
    consumer: TestEnv  # what `run` uses: the consumer user and consumer_app
    bootstrap_url: str
    migrate_dsn: str
    admin_url: str
    cluster: Cluster

    def bootstrap_env(self, **overrides: str) -> dict[str, str]:
        return self.consumer.env(amqp_url=self.bootstrap_url, **overrides)

    @property
    def app_dsn(self) -> str:
        return self.consumer.database_url

    @property
    def admin_dsn(self) -> str:
        """For the test's own reads: the superuser."""
        return self.cluster.dsn(self.name)


@pytest.fixture
async def locked_down(
    broker: Broker, cluster: Cluster, unique: str, secret_dir: Path, tmp_path: Path
) -> LockedDown:
    passwords = {role: secrets.token_urlsafe(16) for role in ("mq", "boot", "app", "migrate")}
    files = {role: write_secret(secret_dir, role, value) for role, value in passwords.items()}
    apply_users_sh(
        broker,
        tmp_path,
        name=unique,
        consumer_password=files["mq"],
        bootstrap_password=files["boot"],
    )
    apply_roles_sql(cluster, unique, app_password=files["app"], migrate_password=files["migrate"])
    world = LockedDown(
        name=unique,
        consumer=TestEnv(
            name=unique,
            database_url=cluster.dsn(unique, "consumer_app", passwords["app"]),
            amqp_url=broker.url(unique, passwords["mq"]),
            http_port=free_port(),
            log_dir=tmp_path,
        ),
        bootstrap_url=broker.url(f"{unique}-bootstrap", passwords["boot"]),
        migrate_dsn=cluster.dsn(unique, "consumer_migrate", passwords["migrate"]),
        admin_url=broker.admin_url,
        cluster=cluster,
    )
    # The migration role makes the schema; the bootstrap user the topology.
    migrate = run_cli("consumer", "migrate", env=world.consumer.env(database_url=world.migrate_dsn))
    assert migrate.returncode == 0, migrate.stderr
    topology = run_cli("topology", "apply", env=world.bootstrap_env())
    assert topology.returncode == 0, topology.stderr
    # The test handler's own tables, granted as a migration adding them would.
    await admin_execute(
        cluster,
        unique,
        (REPO / "tests" / "handlers" / "schema.sql").read_text()
        + "GRANT SELECT, INSERT ON test_effects, handler_calls TO consumer_app;",
    )
    return world


async def test_the_service_runs_end_to_end_under_the_least_privileged_accounts(
    locked_down: LockedDown,
) -> None:
    world = locked_down
    names = world.consumer.names
    # Given the service running as the consumer user (no configure permission at all: its
    # topology check is passive) and consumer_app, applying events in batches
    service = ServiceProcess(world.consumer, batch_size="8", batch_wait="200ms")
    await service.start().wait_ready()

    # When events arrive that succeed, retry once, and fail for good (the restock first: no
    # order between events is promised)
    async with world.consumer.producer(world.bootstrap_url) as producer:
        await producer.send("inventory.restock", {"sku": "LP-1", "qty": 5})

        async def stocked() -> bool:
            return bool(await fetchval(world.admin_dsn, "SELECT count(*) FROM stock") == 1)

        await wait_until(stocked, what="the restock")
        await producer.send("inventory.reserve", {"order_id": "o-1", "sku": "LP-1", "qty": 2})
        await producer.send("notification.requested", {"recipient": "r", "template": "t"})
        retried = await producer.send("test.behave", behave("retried", fail_transient=1))
        dead = await producer.send(
            "inventory.reserve", {"order_id": "o-2", "sku": "NONE", "qty": 1}
        )

    # Then each is applied, the retry went through <name>.retry and the failure to <name>.dead
    async def done() -> bool:
        return (
            await fetchval(world.admin_dsn, "SELECT available FROM stock WHERE sku = 'LP-1'") == 3
            and await fetchval(world.admin_dsn, "SELECT count(*) FROM notifications") == 1
            and await fetchval(world.admin_dsn, "SELECT count(*) FROM test_effects") == 1
            and await queue_depth(world.admin_url, names.dead) == 1
        )

    await wait_until(done, what="every event applied or dead-lettered")
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 1
    # (a batch may run a handler more than once; only its committed run counts)
    calls = await fetchval(
        world.admin_dsn, "SELECT count(*) FROM handler_calls WHERE event_id = $1", retried
    )
    assert calls >= 2

    # And the bootstrap user reads the dead letter with the dlq tools
    listed = run_cli("consumer", "dlq", "list", "--json", env=world.bootstrap_env())
    assert listed.returncode == 0, listed.stderr
    assert str(dead) in listed.stdout
    assert "permanent_failure" in listed.stdout
    assert await service.stop() == 0


async def test_each_account_can_do_only_its_own_part(
    locked_down: LockedDown, broker: Broker, tmp_path: Path
) -> None:
    world = locked_down
    names = world.consumer.names
    settings = world.consumer.settings()
    topology = topology_for(settings, HandlerRegistry.from_modules(settings.handlers))
    connection = await aio_pika.connect(world.consumer.amqp_url)

    async def attempt(action: str, resource: str) -> None:
        channel = await connection.channel()
        if action == "configure":
            await channel.declare_queue(
                resource, durable=True, arguments={"x-queue-type": "quorum"}
            )
        elif action == "write":
            exchange = await channel.get_exchange(resource, ensure=False)
            await exchange.publish(aio_pika.Message(b"{}"), routing_key="x")
        else:
            queue = await channel.get_queue(resource, ensure=False)
            await queue.get(fail=False)

    async def refused(action: str, *, resource: str) -> str:
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused) as caught:
            await attempt(action, resource)
        return str(caught.value)

    try:
        # The consumer user checks the whole topology passively: no configure permission needed
        assert await missing(connection, topology) == []
        # It may consume its work queue and publish to its retry and dead-letter exchanges
        channel = await connection.channel()
        await (await channel.get_queue(names.work, ensure=False)).get(fail=False)
        for exchange in (names.retry, names.dlx):
            target = await channel.get_exchange(exchange, ensure=False)
            await target.publish(aio_pika.Message(b"{}"), routing_key="x")
        # and nothing else: not declare, not publish to the ingress, not read the dead letters
        assert "refused for user" in await refused("configure", resource=names.work)
        assert "refused for user" in await refused("write", resource=settings.exchange)
        assert "refused for user" in await refused("write", resource=names.redeliver)
        assert "refused for user" in await refused("read", resource=names.dead)
    finally:
        await connection.close()

    # The bootstrap user owns the service's names and no one else's
    bootstrap = await aio_pika.connect(world.bootstrap_url)
    try:
        channel = await bootstrap.channel()
        with pytest.raises(aiormq.exceptions.ChannelAccessRefused):
            await channel.declare_queue("someone-else.work", durable=True)
    finally:
        await bootstrap.close()

    # Running the users script again without password files changes nothing
    again = apply_users_sh(
        broker, tmp_path, name=world.name, consumer_password=None, bootstrap_password=None
    )
    assert f"user {world.name}: exists, password unchanged" in again.stdout
    listed = broker.node._ctl("list_user_permissions", world.name, "--formatter", "json")
    n = world.name
    assert json.loads(listed.stdout) == [
        {
            "vhost": "/",
            "configure": "^$",
            "write": f"^{n}\\.([A-Za-z0-9][A-Za-z0-9_-]*\\.)?(retry|dlx)$",
            "read": f"^{n}\\.([A-Za-z0-9][A-Za-z0-9_-]*\\.)?work(\\.v[0-9]+)?(\\.s[0-9]+)?$",
        }
    ]
    # which cover a queue table's queues and a sharded queue's shards, and nothing beside them
    (permissions,) = json.loads(listed.stdout)
    readable = [f"{n}.work", f"{n}.work.v2", f"{n}.orders.work", f"{n}.orders.work.v2.s3"]
    assert all(re.search(permissions["read"], queue) for queue in readable)
    unreadable = [f"{n}.dead", f"{n}.orders.dead", f"{n}.orders.retry.1s", f"{n}.a.b.work"]
    assert not any(re.search(permissions["read"], queue) for queue in unreadable)
    assert re.search(permissions["write"], f"{n}.orders.retry")
    assert not re.search(permissions["write"], f"{n}.orders.redeliver")

    # consumer_app cannot migrate, write the ledger or create anything; it reads the ledger
    # (consumer run refuses to start while a migration is pending)
    migrate = run_cli("consumer", "migrate", env=world.consumer.env())
    assert one_line_error(migrate, 1) == (
        "error: migration failed: InsufficientPrivilegeError: permission denied for schema public"
    )
    assert await fetchval(world.app_dsn, "SELECT count(*) FROM consumer_migrations") > 0
    for sql in (
        "DELETE FROM consumer_migrations",
        "INSERT INTO consumer_migrations VALUES ('x', '001_x.sql', 'x')",
        "SELECT count(*) FROM notifications",
    ):
        with pytest.raises(Exception, match="permission denied for table"):
            await fetchval(world.app_dsn, sql)


async def test_a_consumer_user_without_write_on_the_retry_exchange_says_so(
    locked_down: LockedDown, broker: Broker
) -> None:
    world = locked_down
    names = world.consumer.names
    # Given a consumer user that may publish to <name>.dlx but not to <name>.retry
    n = world.name
    broker.node._ctl("set_permissions", "-p", "/", n, "^$", f"^{n}\\.dlx$", f"^{n}\\.work$")
    service = await ServiceProcess(world.consumer).start().wait_ready()

    # When an event fails transiently and its retry copy is published
    async with world.consumer.producer(world.bootstrap_url) as producer:
        await producer.send("test.behave", behave("denied", fail_transient=1))

    # Then the broker's refusal is logged, naming the exchange, the vhost and the user
    refusal = (
        f"ACCESS_REFUSED - access to exchange '{names.retry}' in vhost '/' refused for user '{n}'"
    )

    async def logged() -> bool:
        return refusal in service.log_text()

    await wait_until(logged, what="the refused publish in the log")
    assert "Traceback" not in service.log_text()
    assert await service.stop() == 0


async def test_a_role_without_insert_on_receipts_stops_the_service_with_one_line(
    locked_down: LockedDown,
) -> None:
    world = locked_down
    # Given consumer_app without INSERT on receipts
    await admin_execute(world.cluster, world.name, "REVOKE INSERT ON receipts FROM consumer_app")
    service = await ServiceProcess(world.consumer).start().wait_ready()

    # When an event arrives
    async with world.consumer.producer(world.bootstrap_url) as producer:
        event_id = await producer.send("inventory.restock", {"sku": "LP-2", "qty": 1})

    # Then the service stops (exit 1) with one line naming the table and what was denied
    assert await service.wait_exit() == 1
    errors = [line for line in service.log_text().splitlines() if line.startswith("error: ")]
    assert errors == ["error: cannot write receipts: permission denied for table receipts"]
    assert "Traceback" not in service.log_text()
    # And the event waits in the work queue, not applied, not dead-lettered
    assert await fetchval(world.admin_dsn, "SELECT count(*) FROM stock") == 0
    assert await queue_depth(world.admin_url, world.consumer.names.dead) == 0

    async def returned() -> bool:
        return await queue_depth(world.admin_url, world.consumer.names.work) == 1

    await wait_until(returned, what=f"{event_id} back in the work queue")
