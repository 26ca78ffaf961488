"""A delivery's event bound to its handler: prepared, then ready for a transaction."""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import Any

from consumer.amqp.delivery import Delivery
from consumer.envelope import Envelope
from consumer.registry import Handler

__all__ = ["Prepared", "Ready"]


@dataclass(frozen=True, slots=True)
class Prepared:
    """A delivery's event, validated by its handler's payload model, and that handler."""

    handler: Handler
    event: Envelope[Any]

    def key(self) -> Hashable | None:
        """What the handler locks (its ``key``), None without one or when the function fails:
        a failing key function only costs the routing; the handler still meets the event."""
        key = self.handler.key
        if key is None:
            return None
        try:
            value = key(self.event.payload)
            hash(value)  # routed by its hash: an unhashable key (a list) fails here, not there
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException:
            return None
        return value


@dataclass(slots=True)
class Ready:
    """A prepared delivery on its way through a transaction, and the time its handler took."""

    delivery: Delivery
    handler: Handler
    event: Envelope[Any]
    handler_seconds: float | None = None
    connection_losses: int = 0
    """Times its database connection broke in a row while it was applied isolated, before this
    attempt (what the dispatcher learnt from its earlier verdicts)."""
