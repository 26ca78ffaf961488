"""The workload: ``inventory.reserve`` events for qty 1 of a SKU drawn uniformly from ``skus``.

Every system in a run gets the same events (same seed): the same ids, SKUs and order ids. The
body is the service's JSON envelope (the README's contract); Celery and Dramatiq get the same
envelope as their task's only argument.
"""

from __future__ import annotations

import json
import random
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

EVENT_TYPE = "inventory.reserve"


def sku_name(index: int) -> str:
    return f"SKU-{index}"


@dataclass(frozen=True, slots=True)
class Workload:
    events: int
    skus: int
    seed: int

    def envelopes(self, *, occurred_at: datetime | None = None) -> Iterator[dict[str, Any]]:
        rng = random.Random(self.seed)
        stamp = (occurred_at or datetime.now(UTC)).isoformat()
        for number in range(self.events):
            yield envelope(
                uuid.UUID(int=rng.getrandbits(128), version=4),
                sku_name(rng.randint(1, self.skus)),
                f"o-{number}",
                occurred_at=stamp,
            )

    @property
    def stock_per_sku(self) -> int:
        """Enough that no reservation can fail, however the SKUs fall."""
        return self.events + 1_000


def envelope(event_id: uuid.UUID, sku: str, order_id: str, *, occurred_at: str) -> dict[str, Any]:
    return {
        "event_id": str(event_id),
        "type": EVENT_TYPE,
        "occurred_at": occurred_at,
        "payload": {"order_id": order_id, "sku": sku, "qty": 1},
    }


def encode(value: dict[str, Any]) -> bytes:
    return json.dumps(value, separators=(",", ":")).encode()
