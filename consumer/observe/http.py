"""The HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``, and nothing else.

The endpoint is for probes and scrapes, which connect, send their request at once and are answered
in milliseconds; anything else that connects is bounded, so that nobody can hold it away from them:

- a connection whose request head has not fully arrived :data:`HEAD_TIMEOUT` seconds after it
  opened is closed (a client trickling its headers byte by byte), and any is closed
  :data:`MAX_LIFETIME` seconds after it opened;
- each connection serves one request (``Connection: close``), so none sits idle between requests;
- at most :data:`MAX_CONNECTIONS` are open at once and :data:`MAX_PER_PEER` from one address. A
  connection beyond a bound does not wait for a place: the oldest connection in its way (of its
  address, or of all at the global bound) that is still waiting for its request head, or is older
  than :data:`HEAD_TIMEOUT`, is closed to make room. Refused only when every one in the way is a
  request being answered right now. So idle, half-sent connections (from the probe's own address
  too: a node's kubelet, a shared NAT) can never lock a probe out.

``/readyz`` asks the database at most once a second
(:meth:`consumer.service.supervisor.Service.readiness`).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Any, Protocol, cast

from aiohttp import web
from aiohttp.typedefs import Handler
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

__all__ = [
    "HEAD_TIMEOUT",
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
HEAD_TIMEOUT = 2.0
MAX_LIFETIME = 15.0


class ReadinessLike(Protocol):
    @property
    def ready(self) -> bool: ...

    def as_dict(self) -> dict[str, Any]: ...


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

    app = web.Application(client_max_size=1024, middlewares=[_one_request_per_connection])
    app.router.add_get("/metrics", metrics)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/readyz", readyz)
    return app


@web.middleware
async def _one_request_per_connection(request: web.Request, handler: Handler) -> web.StreamResponse:
    # Answered, a connection closes: it never idles between requests holding a place.
    try:
        response = await handler(request)
    except web.HTTPException as refused:  # 404, 405: a response too
        refused.force_close()
        raise
    response.force_close()
    return response


class _Connections:
    """The open connections, oldest first: all of them, and by peer."""

    def __init__(self) -> None:
        self._all: dict[_Bounded, None] = {}
        self._by_peer: dict[str, dict[_Bounded, None]] = {}

    def admit(self, connection: _Bounded, peer: str) -> bool:
        """Count ``connection`` in, closing one in its way at a bound (see the module); False
        when none may be closed: it is refused."""
        mine = self._by_peer.get(peer, {})
        crowd = (
            mine
            if len(mine) >= MAX_PER_PEER
            else self._all
            if len(self._all) >= MAX_CONNECTIONS
            else None
        )
        if crowd is not None:
            now = time.monotonic()
            victim = next((other for other in crowd if other.evictable(now)), None)
            if victim is None:
                return False
            victim.evict()
        self._all[connection] = None
        self._by_peer.setdefault(peer, {})[connection] = None
        return True

    def remove(self, connection: _Bounded, peer: str) -> None:
        self._all.pop(connection, None)
        mine = self._by_peer.get(peer)
        if mine is not None:
            mine.pop(connection, None)
            if not mine:
                del self._by_peer[peer]


class _Bounded(asyncio.Protocol):
    """aiohttp's protocol for one connection, admitted within the bounds, closed when its request
    head is late or its lifetime is over, or to make room for another."""

    def __init__(self, inner: Any, connections: _Connections) -> None:
        self._inner = inner
        self._connections = connections
        self._peer: str | None = None
        self._transport: asyncio.Transport | None = None
        self._opened = 0.0
        self._waiting = True
        """No whole request head yet."""
        self._tail = b""
        self._timers: list[asyncio.TimerHandle] = []

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        peername = transport.get_extra_info("peername")
        peer = str(peername[0]) if peername else "?"
        self._opened = time.monotonic()
        if not self._connections.admit(self, peer):
            transport.close()
            return
        self._peer = peer
        self._transport = cast(asyncio.Transport, transport)
        loop = asyncio.get_running_loop()
        self._timers = [
            loop.call_later(HEAD_TIMEOUT, self._head_late),
            loop.call_later(MAX_LIFETIME, transport.close),
        ]
        self._inner.connection_made(transport)

    def evictable(self, now: float) -> bool:
        return self._waiting or now - self._opened >= HEAD_TIMEOUT

    def evict(self) -> None:
        """Close it now to make room; it no longer counts from this moment."""
        if self._peer is not None:
            self._connections.remove(self, self._peer)
        if self._transport is not None:
            self._transport.abort()

    def _head_late(self) -> None:
        if self._waiting and self._transport is not None:
            self._transport.close()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._transport is None:
            return  # refused: aiohttp never saw it
        for timer in self._timers:
            timer.cancel()
        if self._peer is not None:
            self._connections.remove(self, self._peer)
        self._transport = None
        self._inner.connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._transport is None:
            return
        if self._waiting:
            # A head ends with an empty line; its end may be split across reads.
            seen = self._tail + data
            if b"\n\r\n" in seen or b"\n\n" in seen:
                self._waiting = False
            self._tail = seen[-2:]
        self._inner.data_received(data)

    def eof_received(self) -> bool | None:
        result: bool | None = self._inner.eof_received() if self._transport is not None else None
        return result

    def pause_writing(self) -> None:
        self._inner.pause_writing()

    def resume_writing(self) -> None:
        self._inner.resume_writing()


class HttpServer:
    """Serves :func:`build_app` on ``host:port`` for the life of the ``async with`` block."""

    def __init__(self, app: web.Application, *, host: str, port: int) -> None:
        # No lingering close: a request body trickled after an answered head is not waited for.
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False, lingering_time=0)
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
