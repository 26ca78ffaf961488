"""Opening connections to RabbitMQ, with errors that say where and why (and no password)."""

from __future__ import annotations

import logging
import os
import socket
import ssl

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection

from consumer import wire
from consumer.redact import scrub
from consumer.settings import Settings
from consumer.tls import amqp_ssl_context, describe_tls_error, find_tls_error

# aiormq logs each failed connection attempt itself, at ERROR. The service sends library records
# to its JSON log (consumer.logs.route_library_logs, a root handler, which still gets them); a
# one-shot command says what failed in its own single line, so without this handler the record
# would reach stderr a second time through logging's last-resort handler.
logging.getLogger("aiormq").addHandler(logging.NullHandler())


CONNECT_TIMEOUT = 10.0
"""Seconds to open a connection: TCP, TLS and the AMQP handshake (not a publish's confirm)."""


class BrokerUnreachable(ConnectionError):
    """RabbitMQ refused or did not answer; the message names the URL without its password."""


class BrokerRejected(BrokerUnreachable):
    """RabbitMQ answered but the connection cannot work as configured: the broker refused the
    credentials, or its TLS certificate did not verify. Waiting will not fix it."""


def connection_name(settings: Settings, role: str) -> str:
    """What ``rabbitmqctl list_connections client_properties`` shows for this process."""
    return f"{settings.name}/{role}@{socket.gethostname()}:{os.getpid()}"


async def connect(settings: Settings, role: str) -> AbstractConnection:
    """A plain (not self-reconnecting) connection: the service supervises reconnects itself.

    No message can break it: the frame decoder is made total first (:mod:`consumer.wire`).
    """
    wire.install()
    where = f"cannot connect to RabbitMQ at {settings.safe_amqp_url}"
    try:
        context = amqp_ssl_context(settings)
    except (OSError, ssl.SSLError) as error:  # checked at start-up; changed since
        raise BrokerRejected(
            f"{where}: cannot load the TLS files: {error.strerror or error}"
        ) from None
    try:
        return await aio_pika.connect(
            settings.amqp_url.get_secret_value(),
            client_properties={"connection_name": connection_name(settings, role)},
            timeout=CONNECT_TIMEOUT,
            ssl_context=context,
        )
    except (OSError, aiormq.exceptions.AMQPError, TimeoutError) as error:
        unreachable = BrokerRejected if _rejected(error) else BrokerUnreachable
        raise unreachable(f"{where}: {describe_amqp_error(error)}") from None


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
