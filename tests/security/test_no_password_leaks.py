"""A distinctive password, and a distinctive wrong one, never appear in anything the service or its
commands print: stdout, stderr, the JSON logs, /metrics, /readyz, in success or failure."""

from __future__ import annotations

import uuid
from pathlib import Path

import aiohttp
import pytest

from tests.security.support import (
    REFERENCE_HANDLERS,
    Broker,
    Cluster,
    apply_roles_sql,
    write_secret,
)
from tests.servers import free_port
from tests.support import ServiceProcess, TestEnv, fetchval, run_cli, wait_until

MARKER = uuid.uuid4().hex[:12]
# An "@" in a password is written %40 in a URL: look for both spellings, and the marker alone.
PASSWORD = f"Cnry-{MARKER}-p@ss"
WRONG_PASSWORD = f"Wrng-{MARKER}-p@ss"
FORBIDDEN = (
    PASSWORD,
    WRONG_PASSWORD,
    PASSWORD.replace("@", "%40"),
    WRONG_PASSWORD.replace("@", "%40"),
    MARKER,
)


def url_password(password: str) -> str:
    return password.replace("@", "%40")


class Outputs:
    """Everything seen, by where it came from."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}

    def add(self, label: str, text: str) -> None:
        self.seen[label] = self.seen.get(label, "") + text

    def cli(self, label: str, *args: str, env: dict[str, str], code: int | None = None) -> str:
        result = run_cli(*args, env=env)
        self.add(label, result.stdout + result.stderr)
        if code is not None:
            assert result.returncode == code, (label, result.stdout, result.stderr)
        return result.stdout + result.stderr

    async def http(self, label: str, port: int) -> None:
        async with aiohttp.ClientSession() as session:
            for path in ("/metrics", "/readyz", "/healthz"):
                async with session.get(f"http://127.0.0.1:{port}{path}") as response:
                    self.add(f"{label} {path}", await response.text())

    def assert_clean(self) -> None:
        for label, text in self.seen.items():
            for secret in FORBIDDEN:
                assert secret not in text, f"{secret!r} leaked into {label}"


@pytest.fixture
def outputs() -> Outputs:
    return Outputs()


async def run_until_logged(
    outputs: Outputs, env: TestEnv, label: str, expected: str, **overrides: str
) -> None:
    """A service started with ``overrides`` until its log says ``expected``; then stopped."""
    service = ServiceProcess(env, label, http_port=str(free_port()), **overrides).start()

    async def logged() -> bool:
        if service.returncode is not None:
            return True
        return expected in service.log_text()

    await wait_until(logged, what=f"{expected!r} in the log of {label}")
    if service.returncode is None:
        await outputs.http(label, service.port)
        await service.stop()
    outputs.add(label, service.log_text())
    assert expected in service.log_text(), service.log_text()


async def test_no_password_in_any_output_of_any_command(
    broker: Broker,
    cluster: Cluster,
    unique: str,
    secret_dir: Path,
    tmp_path: Path,
    outputs: Outputs,
) -> None:
    # Given a RabbitMQ user and both PostgreSQL roles with the canary password
    user = f"leak-{unique}"
    broker.add_user(user, PASSWORD)
    canary_file = write_secret(secret_dir, "password", PASSWORD)
    apply_roles_sql(cluster, unique, app_password=canary_file, migrate_password=canary_file)
    amqp_url = broker.url(user, url_password(PASSWORD))
    app_url = cluster.dsn(unique, "consumer_app", url_password(PASSWORD))
    migrate_url = cluster.dsn(unique, "consumer_migrate", url_password(PASSWORD))
    env = TestEnv(
        name=unique,
        database_url=app_url,
        amqp_url=amqp_url,
        http_port=free_port(),
        log_dir=tmp_path,
        overrides={"handlers": REFERENCE_HANDLERS, "log_level": "DEBUG"},
    )
    wrong_amqp = broker.url(user, url_password(WRONG_PASSWORD))
    wrong_database = cluster.dsn(unique, "consumer_app", url_password(WRONG_PASSWORD))
    nowhere_amqp = f"amqp://{user}:{url_password(PASSWORD)}@127.0.0.1:{free_port()}/"
    nowhere_database = (
        f"postgresql://consumer_app:{url_password(PASSWORD)}@127.0.0.1:{free_port()}/x"
    )

    # When the commands work: migrate, topology apply, the service (its URLs read from files,
    # as from Docker or Kubernetes secrets), publish, dlq list and show
    outputs.cli("migrate", "consumer", "migrate", env=env.env(database_url=migrate_url), code=0)
    outputs.cli("topology apply", "topology", "apply", env=env.env(), code=0)
    service = ServiceProcess(env, "service")
    for setting, value in (("AMQP_URL", amqp_url), ("DATABASE_URL", app_url)):
        del service.environment[f"CONSUMER_{setting}"]
        path = write_secret(secret_dir, setting.lower(), value)
        service.environment[f"CONSUMER_{setting}_FILE"] = str(path)
    await service.start().wait_ready()
    async with env.producer() as producer:
        await producer.send("inventory.restock", {"sku": "LEAK-1", "qty": 2})
        dead = await producer.send("inventory.reserve", {"order_id": "o", "sku": "NONE", "qty": 1})
    outputs.cli(
        "publish",
        *("consumer", "publish", "--type", "inventory.restock"),
        *("--payload", '{"sku": "LEAK-1", "qty": 1}'),
        env=env.env(),
        code=0,
    )

    async def settled() -> bool:
        available = await fetchval(
            cluster.dsn(unique), "SELECT available FROM stock WHERE sku = 'LEAK-1'"
        )
        return bool(
            available == 3
            and await service.metric("consumer_dead_letters_total", reason="permanent_failure")
        )

    await wait_until(settled, what="the events applied and dead-lettered")
    await outputs.http("service", service.port)
    assert str(dead) in outputs.cli("dlq list", "consumer", "dlq", "list", env=env.env(), code=0)
    outputs.cli("dlq show", "consumer", "dlq", "show", str(dead), env=env.env(), code=0)
    assert await service.stop() == 0
    outputs.add("service", service.log_text())

    # And when they fail: a wrong password, an unreachable server, a bad setting
    outputs.cli(
        "topology, wrong password", "topology", "apply", env=env.env(amqp_url=wrong_amqp), code=1
    )
    outputs.cli(
        "dlq, wrong password", "consumer", "dlq", "list", env=env.env(amqp_url=wrong_amqp), code=1
    )
    outputs.cli(
        "publish, no broker",
        "consumer",
        "publish",
        "--type",
        "t",
        "--payload",
        "{}",
        env=env.env(amqp_url=nowhere_amqp),
        code=1,
    )
    outputs.cli(
        "migrate, wrong password",
        "consumer",
        "migrate",
        env=env.env(database_url=wrong_database),
        code=1,
    )
    outputs.cli(
        "migrate, no database",
        "consumer",
        "migrate",
        env=env.env(database_url=nowhere_database),
        code=1,
    )
    outputs.cli(
        "run, wrong database password",
        "consumer",
        "run",
        env=env.env(database_url=wrong_database),
        code=2,
    )
    outputs.cli(
        "bad setting",
        "consumer",
        "run",
        env=env.env(amqp_url=f"http://{user}:{url_password(PASSWORD)}@h/"),
        code=2,
    )
    # libpq's and asyncpg's password query parameters are passwords too
    in_query = cluster.dsn(unique, "consumer_migrate", None) + (
        f"?password={url_password(PASSWORD)}&sslpassword={url_password(PASSWORD)}"
    )
    outputs.cli(
        "migrate, password in the query",
        "consumer",
        "migrate",
        env=env.env(database_url=in_query),
        code=0,
    )
    wrong_in_query = cluster.dsn(unique, "consumer_app", None) + (
        f"?password={url_password(WRONG_PASSWORD)}&sslmode=disable"
    )
    outputs.cli(
        "run, wrong password in the query",
        "consumer",
        "run",
        env=env.env(database_url=wrong_in_query),
        code=2,
    )
    outputs.add(
        "settings with the password in the query",
        str(env.settings(database_url=wrong_in_query).describe()),
    )
    rejected = outputs.cli(
        "run, wrong broker password", "consumer", "run", env=env.env(amqp_url=wrong_amqp), code=2
    )
    assert "authentication failed (check the user and password in CONSUMER_AMQP_URL)" in rejected
    await run_until_logged(outputs, env, "run, no broker", "lost RabbitMQ", amqp_url=nowhere_amqp)
    await run_until_logged(
        outputs,
        env,
        "run, no database",
        "database unreachable at start-up",
        database_url=nowhere_database,
    )
    outputs.add("settings repr", repr(env.settings()) + str(env.settings().describe()))

    # Then the password appears nowhere, neither the right one nor the wrong one
    everything = "".join(outputs.seen.values())
    assert f"{user}:***@" in everything  # the URLs were shown, without their password
    assert "password authentication failed for user" in everything
    outputs.assert_clean()
