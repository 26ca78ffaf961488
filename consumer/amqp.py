"""Opening connections to RabbitMQ, with errors that say where and why (and no password)."""

from __future__ import annotations

import os
import socket

import aio_pika
import aiormq
from aio_pika.abc import AbstractConnection

from consumer.redact import scrub
from consumer.settings import Settings


class BrokerUnreachable(ConnectionError):
    """RabbitMQ refused or did not answer; the message names the URL without its password."""


def connection_name(settings: Settings, role: str) -> str:
    """What ``rabbitmqctl list_connections client_properties`` shows for this process."""
    return f"{settings.name}/{role}@{socket.gethostname()}:{os.getpid()}"


async def connect(settings: Settings, role: str) -> AbstractConnection:
    """A plain (not self-reconnecting) connection: the service supervises reconnects itself."""
    try:
        return await aio_pika.connect(
            settings.amqp_url.get_secret_value(),
            client_properties={"connection_name": connection_name(settings, role)},
            timeout=settings.publish_timeout.total_seconds(),
        )
    except (OSError, aiormq.exceptions.AMQPError, TimeoutError) as error:
        raise BrokerUnreachable(
            f"cannot connect to RabbitMQ at {settings.safe_amqp_url}: {describe_amqp_error(error)}"
        ) from None


def describe_amqp_error(error: BaseException) -> str:
    """A short account of a connection error that never includes the URL it came from."""
    if isinstance(error, aiormq.exceptions.ProbableAuthenticationError):
        return "authentication failed (check the user and password)"
    if isinstance(error, TimeoutError):
        return "timed out"
    if isinstance(error, OSError) and error.strerror:
        return error.strerror
    return scrub(str(error) or type(error).__name__)
