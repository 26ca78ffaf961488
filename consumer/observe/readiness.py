"""What ``/readyz`` says: connected, consuming, the database answering, not paused, workers alive.

The database is asked on a fresh connection at most once every :data:`READINESS_CACHE_SECONDS`,
however many clients ask: a crowd of requests must not become a crowd of backends.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from consumer.db.database import Database
from consumer.errors import ConfigError, DatabaseUnavailable

__all__ = ["DatabaseAnswer", "QueuesReadiness", "Readiness"]

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


@dataclass(frozen=True, slots=True)
class QueuesReadiness:
    """A queue table's readiness: ready when every queue is; the flags of all, and each queue's
    own under ``queues``."""

    queues: Mapping[str, Readiness]

    @property
    def ready(self) -> bool:
        return all(state.ready for state in self.queues.values())

    def as_dict(self) -> dict[str, Any]:
        states = self.queues.values()
        return {
            "broker_connected": all(state.broker_connected for state in states),
            "consuming": all(state.consuming for state in states),
            "database": all(state.database for state in states),
            "paused": any(state.paused for state in states),
            "workers": all(state.workers for state in states),
            "queues": {
                name: {**state.as_dict(), "ready": state.ready}
                for name, state in self.queues.items()
            },
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
