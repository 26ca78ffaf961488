"""A RabbitMQ node and a PostgreSQL cluster of this folder's own, with TLS from a throw-away CA.

The node has its usual plain listener (the tests' own admin connections, as guest) and a TLS
listener that wants a client certificate from the same CA. The cluster accepts TCP connections
over TLS only: ``postgres`` by trust (the tests' admin), every other role by SCRAM password.
Both live for the whole session; each test uses its own names, users and database.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.security.certs import Pki, make_pki
from tests.security.support import Broker, Cluster
from tests.servers import ThrowawayPostgres, ThrowawayRabbit, free_port

_HBA = """\
local   all  all                   trust
hostssl all  postgres 127.0.0.1/32 trust
hostssl all  all      127.0.0.1/32 scram-sha-256
host    all  all      127.0.0.1/32 reject
"""


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def broker(pki: Pki) -> Iterator[Broker]:
    node = ThrowawayRabbit()
    tls_port = free_port()
    ca = node.add_file("ca.pem", pki.ca)
    cert = node.add_file("server.pem", pki.server_cert)
    key = node.add_file("server.key", pki.server_key)
    node.config = [
        f"listeners.ssl.default = 127.0.0.1:{tls_port}",
        f"ssl_options.cacertfile = {ca}",
        f"ssl_options.certfile = {cert}",
        f"ssl_options.keyfile = {key}",
        "ssl_options.verify = verify_peer",
        "ssl_options.fail_if_no_peer_cert = true",
    ]
    node.start()
    yield Broker(node, node.port, tls_port)
    node.destroy()


@pytest.fixture(scope="session")
def cluster(pki: Pki) -> Iterator[Cluster]:
    pg = ThrowawayPostgres(hba=_HBA)
    pg.init()
    cert = pg.add_file("server.pem", pki.server_cert)
    key = pg.add_file("server.key", pki.server_key)  # owned by postgres, 0600, as it insists
    pg.options = {"ssl": "on", "ssl_cert_file": str(cert), "ssl_key_file": str(key)}
    pg.start()
    yield Cluster(pg)
    pg.destroy()


@pytest.fixture
def unique() -> str:
    """A short name no other test uses: for CONSUMER_NAME, users and databases."""
    return f"s{uuid.uuid4().hex[:10]}"


@pytest.fixture
def secret_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "secrets"
    folder.mkdir(mode=0o700)
    return folder
