"""Opening connections to RabbitMQ, with errors that say where and why (and no password).

``CONSUMER_AMQP_URL`` may name several nodes of a cluster, comma-separated: each connection tries
them in turn, starting after the one that last failed, so a dead node costs one attempt, not every
reconnect's first.
"""

from __future__ import annotations

import logging
import os
import socket
import ssl
from dataclasses import dataclass, field

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection
from pydantic import SecretStr

from consumer.amqp import fast_paths
from consumer.amqp.wire import TableLimits
from consumer.config.tls import TlsFiles, amqp_ssl_context, describe_tls_error, find_tls_error
from consumer.errors import BrokerRejected, BrokerUnreachable, BrokerUnsupported, ConfigError
from consumer.redact import redact_url, scrub
from topology.broker_support import asks_version, broker_version, unsupported
from topology.model import Topology

__all__ = [
    "CONNECT_TIMEOUT",
    "BrokerConfig",
    "check_broker_supports",
    "connect",
    "describe_amqp_error",
    "preflight_broker_support",
]

# aiormq logs each failed connection attempt itself, at ERROR. The service sends library records
# to its JSON log (consumer.logs.route_library_logs, a root handler, which still gets them); a
# one-shot command says what failed in its own single line, so without this handler the record
# would reach stderr a second time through logging's last-resort handler.
logging.getLogger("aiormq").addHandler(logging.NullHandler())


CONNECT_TIMEOUT = 10.0
"""Seconds to open a connection to one node: TCP, TLS and the AMQP handshake."""


@dataclass(frozen=True)
class BrokerConfig:
    """Where RabbitMQ is and how to talk to it."""

    urls: tuple[SecretStr, ...]
    """Each node's URL, tried in turn."""
    safe_url: str
    tls: TlsFiles | None = None
    service: str = "consumer"
    prefetch: int = 400
    publish_timeout: float = 10.0
    fast_path: bool = True
    """aiormq with the service's fast paths (:mod:`consumer.amqp.fast_paths`), else its own code."""
    max_body_bytes: int | None = None
    """Bodies larger than this are dropped unread by the service's consumer on the fast path
    (:mod:`consumer.amqp.direct_consume`); None keeps every body. aiormq's own channel reads every
    body whole."""
    header_limits: TableLimits = field(default_factory=TableLimits)
    """What the header decoder refuses before decoding (:mod:`consumer.amqp.wire`)."""
    _next: list[int] = field(default_factory=lambda: [0], compare=False, repr=False)

    def connection_name(self, role: str) -> str:
        """What ``rabbitmqctl list_connections client_properties`` shows for this process."""
        return f"{self.service}/{role}@{socket.gethostname()}:{os.getpid()}"


async def connect(config: BrokerConfig, role: str) -> AbstractConnection:
    """A plain (not self-reconnecting) connection to the first node that takes it, trying them
    in turn: the service supervises reconnects itself. No message can break it: the frame
    decoder is made total first, within ``config.header_limits`` (:mod:`consumer.amqp.wire`);
    with ``config.fast_path`` frames are read in bulk and deliveries handed over without a task
    each (:mod:`consumer.amqp.fast_paths`)."""
    fast_paths.install(fast_path=config.fast_path, header_limits=config.header_limits)
    try:
        context = amqp_ssl_context(config.tls)
    except (OSError, ssl.SSLError) as error:  # checked at start-up; changed since
        raise BrokerRejected(
            f"cannot connect to RabbitMQ at {config.safe_url}: cannot load the TLS files: "
            f"{error.strerror or error}"
        ) from None
    urls = [url.get_secret_value() for url in config.urls]
    start = config._next[0] % len(urls)
    failure: BrokerUnreachable | None = None
    for offset in range(len(urls)):
        index = (start + offset) % len(urls)
        where = f"cannot connect to RabbitMQ at {redact_url(urls[index])}"
        try:
            connection = await aio_pika.connect(
                urls[index],
                client_properties={"connection_name": config.connection_name(role)},
                timeout=CONNECT_TIMEOUT,
                ssl_context=context,
            )
        except (OSError, aiormq.exceptions.AMQPError, TimeoutError) as error:
            if _rejected(error):
                raise BrokerRejected(f"{where}: {describe_amqp_error(error)}") from None
            failure = BrokerUnreachable(f"{where}: {describe_amqp_error(error)}")
            # The next connection starts after this node.
            config._next[0] = index + 1
            continue
        config._next[0] = index
        return connection
    assert failure is not None
    raise failure


def _rejected(error: BaseException) -> bool:
    if isinstance(error, aiormq.exceptions.ProbableAuthenticationError):
        return True
    return isinstance(find_tls_error(error), ssl.SSLCertVerificationError)


def describe_amqp_error(error: BaseException) -> str:
    """A short account of a connection error that never includes the URL it came from."""
    if isinstance(error, aiormq.exceptions.ProbableAuthenticationError):
        return "authentication failed (check the user and password in CONSUMER_AMQP_URL)"
    tls = find_tls_error(error)
    if isinstance(tls, ssl.SSLCertVerificationError):
        hint = "check CONSUMER_AMQP_CA_FILE"
        if "mismatch" in str(tls.verify_message).lower():
            hint = "the URL's host must be a name in the certificate"
        return f"{describe_tls_error(tls)} ({hint})"
    if tls is not None:
        if "CERTIFICATE_REQUIRED" in str(tls.reason):
            return f"{describe_tls_error(tls)} (the broker wants CONSUMER_AMQP_CERT_FILE)"
        return describe_tls_error(tls)
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return scrub(str(error) or type(error).__name__)


def check_broker_supports(connection: AbstractConnection, topology: Topology) -> None:
    """Raise :class:`BrokerUnsupported` (one line) when the broker behind ``connection`` is too
    old for what ``topology`` sets (:func:`topology.broker_support.unsupported`)."""
    transport = connection.transport
    properties = transport.connection.server_properties if transport is not None else {}
    refusal = unsupported(topology, broker_version(properties))
    if refusal is not None:
        raise BrokerUnsupported(refusal)


async def preflight_broker_support(config: BrokerConfig, topology: Topology) -> None:
    """Before the services start (``consumer run``): a plan that asks for a broker version is
    checked on one connection of its own, so that start-up stops with that one line rather than
    with whichever queue's service failed first. A broker out of reach is left to the services'
    own connecting (each session checks again)."""
    if not asks_version(topology):
        return
    try:
        connection = await connect(config, "preflight")
    except BrokerRejected as error:
        raise ConfigError(str(error)) from None
    except BrokerUnreachable:
        return
    try:
        check_broker_supports(connection, topology)
    finally:
        await connection.close()
