"""The HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``, and nothing else.

The endpoint is for probes and scrapes, which are quick; anything else that connects is bounded, so
that nobody can hold it away from them: at most :data:`MAX_CONNECTIONS` open at once and
:data:`MAX_PER_PEER` from one address (more are closed at once), and each closed
:data:`MAX_LIFETIME` seconds after it opened, whether or not a request ever finished arriving (a
client trickling its headers byte by byte). ``/readyz`` asks the database at most once a second
(:meth:`consumer.service.supervisor.Service.readiness`).
"""

from __future__ import annotations

import asyncio
from collections import Counter
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = [
    "MAX_CONNECTIONS",
    "MAX_LIFETIME",
    "MAX_PER_PEER",
    "HttpServer",
    "ReadinessCheck",
    "ReadinessLike",
    "build_app",
]

MAX_CONNECTIONS = 128
MAX_PER_PEER = 16
MAX_LIFETIME = 15.0


class ReadinessLike(Protocol):
    @property
    def ready(self) -> bool: ...

    def as_dict(self) -> dict[str, bool]: ...


ReadinessCheck = Callable[[], Awaitable[ReadinessLike]]


def build_app(registry: CollectorRegistry, readiness: ReadinessCheck) -> web.Application:
    """The three routes; every other path is 404 and every other method 405 (aiohttp's own)."""

    async def metrics(_: web.Request) -> web.Response:
        return web.Response(
            body=generate_latest(registry), headers={"Content-Type": CONTENT_TYPE_LATEST}
        )

    async def healthz(_: web.Request) -> web.Response:
        # Answering at all proves the event loop turns: a blocked loop times the probe out.
        return web.json_response({"status": "ok"})

    async def readyz(_: web.Request) -> web.Response:
        state = await readiness()
        body = {**state.as_dict(), "ready": state.ready}
        return web.json_response(body, status=200 if state.ready else 503)

    app = web.Application(client_max_size=1024)
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


class _Connections:
    """The open connections, counted in all and by peer."""

    def __init__(self) -> None:
        self.total = 0
        self.by_peer: Counter[str] = Counter()


class _Bounded(asyncio.Protocol):
    """aiohttp's protocol for one connection, admitted within the bounds and closed at the end of
    its lifetime."""

    def __init__(self, inner: Any, connections: _Connections) -> None:
        self._inner = inner
        self._connections = connections
        self._peer: str | None = None
        self._deadline: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if peername else "?"
        connections = self._connections
        if connections.total >= MAX_CONNECTIONS or connections.by_peer[peer] >= MAX_PER_PEER:
            transport.close()
            return
        self._peer = peer
        connections.total += 1
        connections.by_peer[peer] += 1
        self._deadline = asyncio.get_running_loop().call_later(MAX_LIFETIME, transport.close)
        self._inner.connection_made(transport)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._peer is None:
            return
        if self._deadline is not None:
            self._deadline.cancel()
        connections = self._connections
        connections.total -= 1
        connections.by_peer[self._peer] -= 1
        if connections.by_peer[self._peer] <= 0:
            del connections.by_peer[self._peer]
        self._peer = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._peer is not None:
            self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received() if self._peer is not None else None
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class HttpServer:
    """Serves :func:`build_app` on ``host:port`` for the life of the ``async with`` block."""

    def __init__(self, app: web.Application, *, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._host = host
        self._port = port
        self._server: asyncio.base_events.Server | None = None

    async def __aenter__(self) -> HttpServer:
        await self._runner.setup()
        handlers = self._runner.server
        assert handlers is not None
        connections = _Connections()
        self._server = await asyncio.get_running_loop().create_server(
            lambda: _Bounded(handlers(), connections),
            self._host,
            self._port,
            reuse_address=True,
        )
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._server is not None:
            self._server.close()
        await self._runner.cleanup()
