"""A broker session whose connection closes while it starts: a lost connection to reconnect
from, not a fault that ends the process (in a queue table, every queue's work with it)."""

from __future__ import annotations

from typing import Any, cast

import pytest

from consumer.amqp import session as session_module
from consumer.amqp.session import BrokerSession
from consumer.errors import ConnectionLost


class ClosingConnection:
    """A connection the broker closes (``close_all_connections``) as the session checks the
    topology: aiormq then refuses a channel with a bare RuntimeError."""

    def __init__(self) -> None:
        self.is_closed = False
        self.close_callbacks: set[Any] = set()

    async def channel(self, **_: Any) -> Any:
        self.is_closed = True
        raise RuntimeError(f"{self!r} closed")

    async def close(self) -> None:
        self.is_closed = True


def _starting(monkeypatch: pytest.MonkeyPatch, missing: Any) -> BrokerSession:
    """A session whose connection is a :class:`ClosingConnection` and whose topology check is
    ``missing``."""
    connection = ClosingConnection()

    async def connect(*_: Any) -> ClosingConnection:
        return connection

    monkeypatch.setattr(session_module, "connect", connect)
    monkeypatch.setattr(session_module, "missing", missing)
    # The session is given no plan here: the broker's version is not what these tests check
    monkeypatch.setattr(session_module, "check_broker_supports", lambda *_: None)
    config = cast(Any, type("Config", (), {"prefetch": 1, "publish_timeout": 1.0})())
    return BrokerSession(
        config, cast(Any, None), "svc.work", "svc.redeliver", lambda _: None, lambda _: None
    )


async def test_a_connection_closed_while_the_session_starts_is_a_lost_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Given a broker that closes the connection while the session checks the topology
    async def missing(conn: ClosingConnection, _: Any) -> list[str]:
        await conn.channel()
        return []

    # When the session starts, then it reports a lost connection (the supervisor reconnects),
    # not aiormq's RuntimeError (which ended the process with exit code 1)
    with pytest.raises(ConnectionLost, match="connection closed while starting"):
        async with _starting(monkeypatch, missing):
            pass


async def test_another_runtime_error_while_starting_is_not_taken_for_a_lost_connection(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def missing(*_: Any) -> list[str]:
        raise RuntimeError("a bug")

    with pytest.raises(RuntimeError, match="a bug"):
        async with _starting(monkeypatch, missing):
            pass
