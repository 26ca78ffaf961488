"""The security deploy scripts: shellcheck on users.sh and compose's two wrappers (roles.sql runs
for real in test_least_privilege and test_no_password_leaks), and compose's one-shot jobs run for
real: the accounts they make are the ones compose's workloads log in as, with the passwords
compose gives them (tests/deploy/test_credentials checks who logs in as whom)."""

from __future__ import annotations

import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import aio_pika
import asyncpg
import pytest

from tests.deploy.support import assert_clean, compose_model, run_tool
from tests.security.support import (
    COMPOSE_ROLES_SH,
    COMPOSE_USERS_SH,
    USERS_SH,
    Broker,
    Cluster,
    rabbitmqctl_for,
)

SYSTEM_PATH = "/usr/sbin:/usr/bin:/sbin:/bin"


@pytest.mark.parametrize("script", [USERS_SH, COMPOSE_USERS_SH, COMPOSE_ROLES_SH])
def test_the_scripts_pass_shellcheck(script: Path) -> None:
    result = run_tool("shellcheck", "--severity=style", str(script))

    assert_clean(result)
    assert not result.stdout.strip(), result.stdout


def _password(url: str) -> str:
    password = urlsplit(url).password
    assert password is not None, url
    return password


def _job_environment(service: str, *keys: str) -> dict[str, str]:
    environment = compose_model()["services"][service]["environment"]
    return {key: environment[key] for key in keys}


def _workload_url(command: str, key: str) -> str:
    """The URL compose gives the service that runs ``consumer <command>``."""
    for service in compose_model()["services"].values():
        if (service.get("command") or [None, None])[:2] == ["consumer", command]:
            url = service["environment"][key]
            assert isinstance(url, str)
            return url
    raise AssertionError(f"no compose service runs consumer {command}")


async def test_compose_users_job_makes_the_users_its_workloads_log_in_as(
    broker: Broker, tmp_path: Path, unique: str
) -> None:
    # Given the rabbitmq-users job's environment, on the test's node under a name of its own
    environment = _job_environment(
        "rabbitmq-users", "RABBITMQ_CONSUMER_PASSWORD", "RABBITMQ_BOOTSTRAP_PASSWORD"
    )

    scratch = tmp_path / "scratch"
    scratch.mkdir()

    # When its script runs (it would target rabbit@rabbitmq; here the test's node)
    result = subprocess.run(
        ["sh", str(COMPOSE_USERS_SH)],
        env={
            "PATH": SYSTEM_PATH,
            "TMPDIR": str(scratch),
            "RABBITMQCTL": str(rabbitmqctl_for(broker, tmp_path)),
            "CONSUMER_NAME": unique,
            **environment,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Then both users exist with the passwords in the consumer's and the topology job's URLs
    assert result.returncode == 0, result.stderr
    assert f"user {unique}: created" in result.stdout
    for user, command in ((unique, "run"), (f"{unique}-bootstrap", "topology")):
        password = _password(_workload_url(command, "CONSUMER_AMQP_URL"))
        connection = await aio_pika.connect(broker.url(user, password))
        await connection.close()
    # and no password file is left behind
    assert not list(scratch.iterdir())


async def test_compose_roles_job_makes_the_roles_its_workloads_log_in_as(
    cluster: Cluster, unique: str, tmp_path: Path
) -> None:
    # Given the postgres-roles job's environment, on the test's cluster with a database of its own
    environment = _job_environment(
        "postgres-roles",
        "PGUSER",
        "PGDATABASE",
        "POSTGRES_MIGRATE_PASSWORD",
        "POSTGRES_APP_PASSWORD",
    )

    # When its script runs as the superuser
    result = subprocess.run(
        ["sh", str(COMPOSE_ROLES_SH)],
        env={
            "PATH": SYSTEM_PATH,
            "TMPDIR": str(tmp_path),
            "PGHOST": "127.0.0.1",
            "PGPORT": str(cluster.port),
            "PGSSLMODE": "require",
            "CONSUMER_DATABASE_NAME": unique,
            **environment,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Then migrate's and the consumer's URLs log in to the new database, which migrate's role owns
    assert result.returncode == 0, result.stderr
    for role, command in (("consumer_migrate", "migrate"), ("consumer_app", "run")):
        password = _password(_workload_url(command, "CONSUMER_DATABASE_URL"))
        connection = await asyncpg.connect(cluster.dsn(unique, role, password), ssl="require")
        try:
            owner = await connection.fetchval(
                "SELECT pg_get_userbyid(datdba) FROM pg_database WHERE datname = current_database()"
            )
            assert await connection.fetchval("SELECT current_user") == role
        finally:
            await connection.close()
        assert owner == "consumer_migrate"
    assert not list(tmp_path.iterdir()), "a password file is left behind"
