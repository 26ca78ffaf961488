"""A stand-in for a bug in the service itself: importing this module makes the judge raise
whenever it judges a :class:`Tripwire`, so the worker judging that event dies of an error nobody
expected (tests/integration/test_service_bug.py). Loaded only by that test's processes.
"""

from __future__ import annotations

from typing import Any

import asyncpg
from pydantic import BaseModel, Field

from consumer import Envelope, register
from consumer.pipeline.judge import Judge


class Tripwire(Exception):
    """Raised by the handler; the patched judge cannot cope with it."""


class JudgeBug(BaseException):
    """What the patched judge raises: not an ``Exception``, so that no worker's or lane's guard
    turns it into the event's failure (as a bug outside the handler would not be)."""


class Trip(BaseModel):
    key: str = Field(min_length=1)


_judged = Judge.failed


def _failed_with_a_bug(self: Judge, delivery: Any, error: BaseException, **kwargs: Any) -> Any:
    if isinstance(error, Tripwire):
        raise JudgeBug("a bug in the judge")
    return _judged(self, delivery, error, **kwargs)


Judge.failed = _failed_with_a_bug  # type: ignore[method-assign]


@register("service_bug.trip", payload=Trip)
async def trip(event: Envelope[Trip], conn: asyncpg.Connection[Any]) -> None:
    raise Tripwire(event.payload.key)
