"""The rows the broker refused for the moment, left out of this relay's next claims for a while.

A round claims the first rows owed, in id order. A row the broker refuses for the moment (nacked:
a queue full with reject-publish overflow, a quorum queue without its quorum; no confirm in time;
the connection lost) stays owed, and stays first: without a rest, once a batch's worth of such
rows had piled up at the head of the outbox, every round took only them, and the rows behind
them, bound for healthy queues, waited for as long as the broker refused those.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["RestingRows", "Skipped"]


@dataclass(frozen=True, slots=True)
class Skipped:
    """What a claim leaves out now: the resting rows, and their keys (a key's later rows must not
    overtake its resting one)."""

    ids: list[int]
    keys: list[str]


@dataclass(slots=True)
class _Rest:
    until: float
    refusals: int
    key: str | None


class RestingRows:
    """Each refused row rests ``first * 2**(n - 1)`` seconds after its n-th refusal in a row, at
    most ``ceiling`` (the relay's poll). Kept in memory, per relay: another replica may take the
    row meanwhile, and a restart forgets the rests (the rows are then tried at once)."""

    def __init__(
        self, first: float, ceiling: float, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self._first = first
        self._ceiling = ceiling
        self._clock = clock
        self._rows: dict[int, _Rest] = {}

    def refused(self, row_id: int, key: str | None) -> None:
        earlier = self._rows.get(row_id)
        refusals = 1 if earlier is None else earlier.refusals + 1
        rest = min(self._ceiling, self._first * 2.0 ** (refusals - 1))
        self._rows[row_id] = _Rest(self._clock() + rest, refusals, key)

    def done(self, row_id: int) -> None:
        """The row is sent, or failed for good: no more rests for it."""
        self._rows.pop(row_id, None)

    def skipped(self) -> Skipped:
        """The rows resting now. A row whose rest ended a whole ceiling ago is forgotten (sent by
        another replica, most likely); one refused again before that rests longer."""
        now = self._clock()
        for row_id in [i for i, rest in self._rows.items() if rest.until + self._ceiling < now]:
            del self._rows[row_id]
        resting = [(row_id, rest) for row_id, rest in self._rows.items() if rest.until > now]
        return Skipped(
            ids=[row_id for row_id, _ in resting],
            keys=sorted({rest.key for _, rest in resting if rest.key is not None}),
        )
