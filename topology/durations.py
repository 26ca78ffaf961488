"""Durations as the broker objects spell them: one unit, in queue names and TTL arguments.

The topology owns this spelling: a rung's queue is named by it, and the service's retry copies
carry it in the header the retry exchange routes on, so there must be exactly one.
"""

from __future__ import annotations

from datetime import timedelta

__all__ = ["format_duration", "to_milliseconds"]


def format_duration(value: timedelta) -> str:
    """The shortest exact spelling of a duration in one unit: ``500ms``, ``5s``, ``2m``, ``1h``.

    Used in queue names, so the same duration always gives the same text (one unit, never a
    compound and never days, which would rename the queues of existing ladders).
    """
    milliseconds = round(value.total_seconds() * 1000)
    if milliseconds % 1000:
        return f"{milliseconds}ms"
    seconds = milliseconds // 1000
    if seconds and seconds % 3600 == 0:
        return f"{seconds // 3600}h"
    if seconds and seconds % 60 == 0:
        return f"{seconds // 60}m"
    return f"{seconds}s"


def to_milliseconds(value: timedelta) -> int:
    """Whole milliseconds, as RabbitMQ's TTL arguments want them."""
    return round(value.total_seconds() * 1000)
