"""Per-event handlers of ``inventory.reserve``, the kinds people write, for ``python -m bench
handlers`` (``CONSUMER_HANDLERS=bench.handlers``).

``BENCH_HANDLER`` picks what each does before the reservation (one statement: the stock change and
its movement row, the peers' statement):

- ``db``: nothing (database-only);
- ``io5`` / ``io50``: awaits 5 / 50 ms (a cache or an HTTP call);
- ``io2s``: awaits 2 s (a report's minutes, shortened; only :mod:`bench.queue_rows` uses it);
- ``cpu2``: 2 ms of pure Python, holding the event loop.

The same effect as the reference batch handler, one event per call: the harness counts
``stock_movements`` and checks each event's receipt and movement.
"""

from __future__ import annotations

import asyncio
import os
import time
from typing import Any

import asyncpg

from consumer import Envelope, PermanentError, register
from consumer.handlers.inventory import _RESERVE_ONE, Reserve

__all__ = ["MODES", "reserve"]

MODES = ("db", "io5", "io50", "cpu2")
_MODE = os.environ.get("BENCH_HANDLER", "db")
_AWAIT = {"io5": 0.005, "io50": 0.05, "io2s": 2.0}.get(_MODE, 0.0)
_CPU = 0.002 if _MODE == "cpu2" else 0.0


def _sku(payload: Reserve) -> str:
    return payload.sku


def _spin(seconds: float) -> int:
    """Pure Python for ``seconds`` of wall time: arithmetic, no I/O, no release of the GIL."""
    until = time.perf_counter() + seconds
    total = 0
    while time.perf_counter() < until:
        for value in range(200):
            total += value * value % 7
    return total


@register("inventory.reserve", payload=Reserve, key=_sku)
async def reserve(event: Envelope[Reserve], conn: asyncpg.Connection[Any]) -> None:
    if _AWAIT:
        await asyncio.sleep(_AWAIT)
    if _CPU:
        _spin(_CPU)
    payload = event.payload
    # The reference handler's statement for an event applied alone (one round trip).
    row = await conn.fetchval(
        _RESERVE_ONE, event.event_id, payload.order_id, payload.sku, payload.qty
    )
    if row is None:
        raise PermanentError(f"cannot reserve {payload.qty} of {payload.sku!r}")
