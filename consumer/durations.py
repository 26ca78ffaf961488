"""Durations as people write them: ``500ms``, ``5s``, ``2m``, ``1h``, ``1d``, and compounds of
those from the largest unit down (``1m30s``, ``1h30m``, ``1d12h``); a bare number is seconds."""

from __future__ import annotations

import re
from datetime import timedelta

__all__ = ["parse_duration"]

_UNIT_SECONDS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0, "ms": 0.001}
_RANK = {unit: rank for rank, unit in enumerate(_UNIT_SECONDS)}
# ms before m and s, so that "500ms" is not read as 500 minutes and an "s".
_PART = re.compile(r"(\d+(?:\.\d+)?)(ms|d|h|m|s)", re.IGNORECASE)
_BARE_SECONDS = re.compile(r"\d+(?:\.\d+)?")
_HINT = "write it like 500ms, 5s, 2m, 1h, 1d or 1m30s"


def parse_duration(value: object) -> timedelta:
    """Parse ``500ms``, ``5s``, ``1m30s``, ``1d`` or a bare number of seconds into a timedelta.

    Raises ``ValueError`` with a message fit to show a person. The message does not repeat the
    value: whoever shows it (the settings' error line) names the value once.
    """
    if isinstance(value, timedelta):
        return value
    if isinstance(value, bool):
        raise ValueError("is not a duration")
    if isinstance(value, int | float):
        if value < 0:
            raise ValueError("is negative")
        return _seconds(value)
    if not isinstance(value, str):
        raise ValueError("is not a duration")
    text = value.strip()
    if _BARE_SECONDS.fullmatch(text):
        return _seconds(float(text))
    return _seconds(_compound_seconds(text))


def _seconds(seconds: float) -> timedelta:
    # timedelta raises OverflowError past 999999999 days: a bad value, told as one (one line at
    # start-up naming the setting), not a traceback.
    try:
        return timedelta(seconds=seconds)
    except OverflowError:
        raise ValueError("is too long (at most 999999999 days)") from None


def _compound_seconds(text: str) -> float:
    seconds = 0.0
    position = 0
    last_rank = -1
    for match in _PART.finditer(text):
        if match.start() != position:
            break
        unit = match[2].lower()
        # Largest unit first, each once: "30s1m" or "1m1m" is more likely a typo than a wish.
        if _RANK[unit] <= last_rank:
            raise ValueError(f"is not a duration (units go from the largest down; {_HINT})")
        last_rank = _RANK[unit]
        seconds += float(match[1]) * _UNIT_SECONDS[unit]
        position = match.end()
    if last_rank < 0 or position != len(text):
        raise ValueError(f"is not a duration ({_HINT})")
    return seconds
