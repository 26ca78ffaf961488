"""TLS to RabbitMQ and PostgreSQL, for real: a throw-away CA, a broker that wants client
certificates, a database that refuses connections without TLS."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.security.certs import Pki
from tests.security.support import REFERENCE_HANDLERS, Broker, Cluster, one_line_error
from tests.servers import free_port
from tests.support import ServiceProcess, TestEnv, fetchval, run_cli, wait_until


def tls_env(broker: Broker, cluster: Cluster, pki: Pki, name: str, log_dir: Path) -> TestEnv:
    """Settings for the service over TLS to both servers, trusting the test CA."""
    return TestEnv(
        name=name,
        database_url=cluster.dsn(name),
        amqp_url=broker.url("guest", "guest", tls=True),
        http_port=free_port(),
        log_dir=log_dir,
        overrides={
            "handlers": REFERENCE_HANDLERS,
            "amqp_ca_file": str(pki.ca),
            "amqp_cert_file": str(pki.client_cert),
            "amqp_key_file": str(pki.client_key),
            "database_sslmode": "verify-full",
            "database_sslrootcert": str(pki.ca),
        },
    )


def without(environment: dict[str, str], *settings: str) -> dict[str, str]:
    return {
        k: v for k, v in environment.items() if k.removeprefix("CONSUMER_").lower() not in settings
    }


def broker_connections(broker: Broker) -> list[dict[str, Any]]:
    listed = broker.node._ctl(
        "list_connections", "port", "ssl", "peer_cert_subject", "--formatter", "json"
    )
    connections: list[dict[str, Any]] = json.loads(listed.stdout)
    return connections


async def test_the_service_works_end_to_end_over_tls_to_both(
    broker: Broker, cluster: Cluster, pki: Pki, unique: str, tmp_path: Path
) -> None:
    # Given a broker taking TLS clients with a certificate from the test CA, and a database that
    # takes TLS connections only
    env = tls_env(broker, cluster, pki, unique, tmp_path)

    # When the database is made and migrated, the topology applied, the service started and an
    # event published, each over TLS
    migrate = run_cli("consumer", "migrate", "--create-database", env=env.env())
    assert migrate.returncode == 0, migrate.stderr
    assert f"created database {unique}" in migrate.stdout
    topology = run_cli("topology", "apply", env=env.env())
    assert topology.returncode == 0, topology.stderr
    service = await ServiceProcess(env).start().wait_ready()
    published = run_cli(
        "consumer",
        "publish",
        "--type",
        "inventory.restock",
        "--payload",
        json.dumps({"sku": "TLS-1", "qty": 3}),
        env=env.env(),
    )
    assert published.returncode == 0, published.stderr

    # Then the event is applied
    database = cluster.dsn(unique)

    async def applied() -> bool:
        return bool(
            await fetchval(database, "SELECT available FROM stock WHERE sku = 'TLS-1'") == 3
        )

    await wait_until(applied, what="the restock over TLS")

    # And the broker and the database both see the service's connections as TLS, the broker
    # with the client certificate
    on_tls_port = [c for c in broker_connections(broker) if c["port"] == broker.tls_port]
    assert on_tls_port
    for connection in on_tls_port:
        assert connection["ssl"] is True
        assert "CN=client" in str(connection["peer_cert_subject"])
    ssl_in_use = await fetchval(
        database,
        "SELECT bool_and(s.ssl) FROM pg_stat_activity AS a JOIN pg_stat_ssl AS s USING (pid) "
        "WHERE a.application_name = $1",
        unique,
    )
    assert ssl_in_use is True
    assert await service.stop() == 0


async def test_a_wrong_ca_is_one_clear_line_for_the_broker_and_for_the_database(
    broker: Broker, cluster: Cluster, pki: Pki, unique: str, tmp_path: Path
) -> None:
    # Given a migrated database and applied topology, over TLS with the right CA
    env = tls_env(broker, cluster, pki, unique, tmp_path)
    assert run_cli("consumer", "migrate", "--create-database", env=env.env()).returncode == 0
    assert run_cli("topology", "apply", env=env.env()).returncode == 0
    wrong = str(pki.wrong_ca)

    # When each command trusts a CA that did not sign the server's certificate
    topology = run_cli("topology", "apply", env=env.env(amqp_ca_file=wrong))
    dlq = run_cli("consumer", "dlq", "list", env=env.env(amqp_ca_file=wrong))
    migrate = run_cli("consumer", "migrate", env=env.env(database_sslrootcert=wrong))
    run = run_cli("consumer", "run", env=env.env(database_sslrootcert=wrong), timeout=30)

    # Then each stops with one line saying so, naming the setting to check
    broker_line = (
        f"error: cannot connect to RabbitMQ at amqps://guest:***@127.0.0.1:{broker.tls_port}/: "
        "the server's TLS certificate was rejected: self-signed certificate in certificate chain "
        "(check CONSUMER_AMQP_CA_FILE)"
    )
    assert one_line_error(topology, 1) == broker_line
    assert one_line_error(dlq, 1) == broker_line
    database_line = (
        f"error: cannot connect to PostgreSQL at postgresql://postgres@127.0.0.1:{cluster.port}/"
        f"{unique}: the server's TLS certificate was rejected: unable to get local issuer "
        "certificate (check CONSUMER_DATABASE_SSLROOTCERT and CONSUMER_DATABASE_SSLMODE)"
    )
    assert one_line_error(migrate, 2) == database_line
    # The service does not take it for an outage to wait out: it stops at once, exit 2
    assert one_line_error(run, 2) == database_line

    # And the service trusting the wrong CA for the broker stops at start-up the same way
    run_broker = run_cli("consumer", "run", env=env.env(amqp_ca_file=wrong), timeout=30)
    assert one_line_error(run_broker, 2) == broker_line


async def test_the_certificate_must_name_the_host_unless_that_check_is_turned_off(
    broker: Broker, cluster: Cluster, pki: Pki, unique: str, tmp_path: Path
) -> None:
    # Given server certificates that name 127.0.0.1 only, reached as "localhost"
    env = tls_env(broker, cluster, pki, unique, tmp_path)
    via_localhost = broker.url("guest", "guest", tls=True, host="localhost")
    database_via_localhost = cluster.dsn(unique).replace("127.0.0.1", "localhost")

    # When the broker and the database are reached by that other name
    refused = run_cli("topology", "apply", env=env.env(amqp_url=via_localhost))
    refused_db = run_cli(
        "consumer", "migrate", "--create-database", env=env.env(database_url=database_via_localhost)
    )

    # Then both refuse, saying why
    line = one_line_error(refused, 1)
    assert "Hostname mismatch, certificate is not valid for 'localhost'" in line
    assert "(the URL's host must be a name in the certificate)" in line
    line = one_line_error(refused_db, 2)
    assert "Hostname mismatch, certificate is not valid for 'localhost'" in line

    # And the explicit opt-outs accept the certificate for its CA alone
    allowed = run_cli(
        "topology", "apply", env=env.env(amqp_url=via_localhost, amqp_verify_hostname="false")
    )
    assert allowed.returncode == 0, allowed.stderr
    allowed_db = run_cli(
        "consumer",
        "migrate",
        "--create-database",
        env=env.env(database_url=database_via_localhost, database_sslmode="verify-ca"),
    )
    assert allowed_db.returncode == 0, allowed_db.stderr


async def test_the_broker_wants_a_client_certificate_and_the_database_wants_tls(
    broker: Broker, cluster: Cluster, pki: Pki, unique: str, tmp_path: Path
) -> None:
    env = tls_env(broker, cluster, pki, unique, tmp_path)

    # When a client comes without a certificate, and another without TLS
    no_certificate = run_cli(
        "topology", "apply", env=without(env.env(), "amqp_cert_file", "amqp_key_file")
    )
    no_tls = run_cli(
        "consumer",
        "migrate",
        "--create-database",
        env=without(env.env(database_sslmode="disable"), "database_sslrootcert"),
    )

    # Then both are refused, with one line each
    line = one_line_error(no_certificate, 1)
    assert line.startswith("error: cannot connect to RabbitMQ at amqps://guest:***@127.0.0.1:")
    # TLS 1.3 finishes the client's side of the handshake before the broker checks for a
    # certificate: the client reads either the broker's alert or the reset that follows it.
    assert (
        "tlsv13 alert certificate required (the broker wants CONSUMER_AMQP_CERT_FILE)" in line
        or "Connection reset by peer" in line
    ), line
    line = one_line_error(no_tls, 1)
    assert "pg_hba.conf rejects connection" in line
    assert "no encryption" in line
