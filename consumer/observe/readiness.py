"""What ``/readyz`` says: connected, consuming, the database answering, not paused, workers alive.

The database is asked on a fresh connection at most once every :data:`READINESS_CACHE_SECONDS`,
however many clients ask: a crowd of requests must not become a crowd of backends.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from consumer.db.database import Database
from consumer.errors import ConfigError, DatabaseUnavailable

__all__ = ["DatabaseAnswer", "Readiness"]

READINESS_CACHE_SECONDS = 1.0


@dataclass(frozen=True, slots=True)
class Readiness:
    broker_connected: bool
    consuming: bool
    database: bool
    paused: bool
    workers: bool = True

    @property
    def ready(self) -> bool:
        return (
            self.broker_connected
            and self.consuming
            and self.database
            and not self.paused
            and self.workers
        )

    def as_dict(self) -> dict[str, bool]:
        return {
            "broker_connected": self.broker_connected,
            "consuming": self.consuming,
            "database": self.database,
            "paused": self.paused,
            "workers": self.workers,
        }


class DatabaseAnswer:
    """Whether the database answers a probe, asked once for concurrent callers, and reused."""

    def __init__(self) -> None:
        self._answer: tuple[float, bool] | None = None
        self._probe: asyncio.Future[bool] | None = None

    async def ask(self, database: Database | None) -> bool:
        if self._answer is not None:
            asked_at, answer = self._answer
            if time.monotonic() - asked_at < READINESS_CACHE_SECONDS:
                return answer
        if self._probe is None or self._probe.done():
            self._probe = asyncio.ensure_future(self._ask_now(database))
        return await asyncio.shield(self._probe)

    async def _ask_now(self, database: Database | None) -> bool:
        answer = False
        if database is not None:
            try:
                await database.probe()
                answer = True
            except (DatabaseUnavailable, ConfigError):
                answer = False
        self._answer = (time.monotonic(), answer)
        return answer
