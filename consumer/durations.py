"""Durations as people write them: ``500ms``, ``5s``, ``2m``, ``1h``; a bare number is seconds."""

from __future__ import annotations

import re
from datetime import timedelta

_DURATION = re.compile(r"^\s*(?P<value>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m|h)?\s*$", re.IGNORECASE)
_UNIT_SECONDS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(value: object) -> timedelta:
    """Parse ``500ms``, ``5s``, ``2m``, ``1h`` or a bare number of seconds into a timedelta.

    Raises ``ValueError`` with a message fit to show a person.
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError(f"{value!r} is not a duration")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError(f"{value!r} is negative")
        return timedelta(seconds=value)
    if not isinstance(value, str):
        raise ValueError(f"{value!r} is not a duration")
    match = _DURATION.match(value)
    if match is None:
        raise ValueError(f"{value!r} is not a duration (write it like 500ms, 5s, 2m or 1h)")
    unit = (match["unit"] or "s").lower()
    return timedelta(seconds=float(match["value"]) * _UNIT_SECONDS[unit])


def format_duration(value: timedelta) -> str:
    """The shortest exact spelling of a duration: ``500ms``, ``5s``, ``2m``, ``1h``.

    Used in queue names, so the same duration always gives the same text.
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
