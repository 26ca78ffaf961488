"""Capped exponential backoff with jitter, for reconnecting and probing."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

__all__ = ["Backoff"]


@dataclass(slots=True)
class Backoff:
    """Delays of ``initial * 2**n`` seconds, capped at ``maximum``, jittered
    down by up to half.

    Jitter keeps replicas that lost the same broker from reconnecting in lockstep.
    """

    initial: float
    maximum: float
    rng: random.Random = field(default_factory=random.Random)
    _failures: int = 0

    def next(self) -> float:
        delay = min(self.maximum, self.initial * 2.0**self._failures)
        self._failures = min(self._failures + 1, 32)
        return delay * (0.5 + 0.5 * self.rng.random())

    def reset(self) -> None:
        self._failures = 0
