"""The HTTP endpoint: ``/metrics``, ``/healthz`` and ``/readyz``, and nothing else."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from types import TracebackType
from typing import Protocol

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest


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


class HttpServer:
    """Serves :func:`build_app` on ``host:port`` for the life of the ``async with`` block."""

    def __init__(self, app: web.Application, *, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None, handle_signals=False)
        self._host = host
        self._port = port

    async def __aenter__(self) -> HttpServer:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port, reuse_address=True)
        await site.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self._runner.cleanup()
