"""Helpers for the security tests: the deploy scripts run for real, and one-line error checks."""

from __future__ import annotations

import shlex
import subprocess
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from tests.servers import ThrowawayPostgres, ThrowawayRabbit
from tests.support import REPO

ROLES_SQL = REPO / "deploy" / "postgres" / "roles.sql"
USERS_SH = REPO / "deploy" / "rabbitmq" / "users.sh"
# compose.yaml's one-shot jobs: users.sh and roles.sql with passwords from the environment
COMPOSE_USERS_SH = REPO / "deploy" / "rabbitmq" / "compose-users.sh"
COMPOSE_ROLES_SH = REPO / "deploy" / "postgres" / "compose-roles.sh"
REFERENCE_HANDLERS = "consumer.handlers.inventory,consumer.handlers.notifications"


@dataclass(frozen=True, slots=True)
class Broker:
    node: ThrowawayRabbit
    port: int
    tls_port: int

    @property
    def admin_url(self) -> str:
        return f"amqp://guest:guest@127.0.0.1:{self.port}/"

    def url(self, user: str, password: str, *, tls: bool = False, host: str = "127.0.0.1") -> str:
        scheme, port = ("amqps", self.tls_port) if tls else ("amqp", self.port)
        return f"{scheme}://{user}:{password}@{host}:{port}/"

    def add_user(self, user: str, password: str, *permissions: str) -> None:
        """A user with ``permissions`` (configure, write, read) on the default vhost."""
        self.node._ctl("add_user", user, input_text=f"{password}\n")
        self.node._ctl("set_permissions", "-p", "/", user, *(permissions or (".*",) * 3))


@dataclass(frozen=True, slots=True)
class Cluster:
    pg: ThrowawayPostgres

    @property
    def port(self) -> int:
        return self.pg.port

    @property
    def admin_dsn(self) -> str:
        return self.pg.admin_dsn

    def dsn(self, database: str, user: str = "postgres", password: str | None = None) -> str:
        secret = f":{password}" if password is not None else ""
        return f"postgresql://{user}{secret}@127.0.0.1:{self.pg.port}/{database}"


def one_line_error(result: subprocess.CompletedProcess[str], code: int) -> str:
    """The single line a failing command printed to stderr (asserting there is only that)."""
    assert result.returncode == code, (result.returncode, result.stdout, result.stderr)
    assert "Traceback" not in result.stderr, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("error: "), lines[0]
    return lines[0]


def write_secret(folder: Path, name: str, value: str) -> Path:
    path = folder / name
    path.write_text(value + "\n")
    path.chmod(0o600)
    return path


def apply_roles_sql(
    cluster: Cluster, database: str, *, app_password: Path, migrate_password: Path
) -> subprocess.CompletedProcess[str]:
    """``deploy/postgres/roles.sql`` as its header says to run it, passwords from files."""
    result = subprocess.run(
        [
            "psql",
            f"{cluster.admin_dsn}?sslmode=require",
            "-X",
            "-q",
            "-v",
            "ON_ERROR_STOP=1",
            "-v",
            f"database={database}",
            "-v",
            f"app_password_file={app_password}",
            "-v",
            f"migrate_password_file={migrate_password}",
            "-f",
            str(ROLES_SQL),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


def rabbitmqctl_for(broker: Broker, folder: Path) -> Path:
    """An executable that runs rabbitmqctl against the test's node (for ``RABBITMQCTL``)."""
    wrapper = folder / "rabbitmqctl"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.join(broker.node.ctl_command())} "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


def apply_users_sh(
    broker: Broker,
    tmp_path: Path,
    *,
    name: str,
    consumer_password: Path | None,
    bootstrap_password: Path | None,
) -> subprocess.CompletedProcess[str]:
    """``deploy/rabbitmq/users.sh`` against the test's node (rabbitmqctl through a wrapper)."""
    wrapper = rabbitmqctl_for(broker, tmp_path)
    passwords = {
        key: str(path)
        for key, path in (
            ("CONSUMER_PASSWORD_FILE", consumer_password),
            ("BOOTSTRAP_PASSWORD_FILE", bootstrap_password),
        )
        if path is not None
    }
    result = subprocess.run(
        [str(USERS_SH)],
        env={
            "PATH": "/usr/sbin:/usr/bin:/sbin:/bin",
            "RABBITMQCTL": str(wrapper),
            "CONSUMER_NAME": name,
            **passwords,
        },
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return result


async def admin_execute(cluster: Cluster, database: str, sql: str) -> None:
    conn = await asyncpg.connect(cluster.dsn(database))
    try:
        await conn.execute(sql)
    finally:
        await conn.close()
