"""The retry policy: a pure function from (error, attempts so far, ladder) to a decision.

The ladder is the list of delays in ``CONSUMER_RETRY_DELAYS``; rung ``i`` is the delay queue a
message waits in before its ``i+1``-th retry. The attempt count travels in the message (a header the
service owns), never in process memory, so a restart cannot reset it.
"""

from __future__ import annotations

import enum
import random
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

from consumer.classification import ErrorKind, classify, timed_out
from consumer.errors import PermanentError

__all__ = [
    "MAX_CONNECTION_LOSSES",
    "DeadLetter",
    "DeadLetterReason",
    "Decision",
    "Retry",
    "RetryPolicy",
    "Return",
    "jittered_expiration",
]

MAX_CONNECTION_LOSSES = 3
"""An event applied isolated whose database connection breaks this many times in a row (with the
database answering in between) is dead-lettered instead of being held for ever."""


class DeadLetterReason(enum.StrEnum):
    """Why the service dead-lettered an event it could parse."""

    PERMANENT_FAILURE = "permanent_failure"
    RETRIES_EXHAUSTED = "retries_exhausted"
    HARD_TIME_LIMIT = "hard_time_limit"
    CRASHED = "crashed"
    CONNECTION_LOST = "connection_lost"
    EXPIRED = "expired"
    ID_CONFLICT = "id_conflict"
    INVALID_PUBLISH = "invalid_publish"


@dataclass(frozen=True, slots=True)
class Retry:
    """Publish to rung ``rung`` (0-based); the copy carries ``attempt`` (1 for the first retry)."""

    rung: int
    delay: timedelta
    attempt: int


@dataclass(frozen=True, slots=True)
class DeadLetter:
    """Publish to the dead-letter exchange with ``reason``; no receipt, no effect."""

    reason: DeadLetterReason


@dataclass(frozen=True, slots=True)
class Return:
    """Give the message back to the work queue without counting an attempt (database down)."""


Decision = Retry | DeadLetter | Return


@dataclass(frozen=True, slots=True)
class RetryPolicy:
    """Bounded retries along a TTL ladder; see :meth:`decide`."""

    ladder: tuple[timedelta, ...]

    @classmethod
    def from_delays(cls, delays: Sequence[timedelta]) -> RetryPolicy:
        return cls(tuple(delays))

    def decide(
        self,
        error: BaseException,
        attempts_so_far: int,
        connection_losses: int = 0,
        *,
        database_answers: bool = True,
    ) -> Decision:
        """What to do with an event that raised ``error`` after ``attempts_so_far`` retries.

        Transient errors climb the ladder until it is exhausted; permanent ones are dead-lettered
        at once; a database that cannot be reached returns the message, counting nothing, unless
        the event itself has broken its connection :data:`MAX_CONNECTION_LOSSES` times in a row.
        A time limit that ran out while the database does not answer (``database_answers``, a
        probe after the fact: a frozen server, a partition) is the database's, not the event's.
        """
        kind = classify(error)
        if kind is ErrorKind.UNAVAILABLE or (timed_out(error) and not database_answers):
            if connection_losses >= MAX_CONNECTION_LOSSES:
                return DeadLetter(DeadLetterReason.CONNECTION_LOST)
            return Return()
        if kind is ErrorKind.PERMANENT:
            reason = getattr(error, "reason", None) if isinstance(error, PermanentError) else None
            if not isinstance(reason, str) or reason not in _REASONS:
                # A handler's own error may well carry a `reason` of its own (card_declined):
                # the dead letter's reason is the service's word, so that is a permanent failure.
                reason = DeadLetterReason.PERMANENT_FAILURE
            return DeadLetter(DeadLetterReason(reason))
        attempts_so_far = max(attempts_so_far, 0)
        if attempts_so_far >= len(self.ladder):
            return DeadLetter(DeadLetterReason.RETRIES_EXHAUSTED)
        return Retry(
            rung=attempts_so_far, delay=self.ladder[attempts_so_far], attempt=attempts_so_far + 1
        )


_REASONS = frozenset(reason.value for reason in DeadLetterReason)


def jittered_expiration(delay: timedelta, jitter: float, rng: random.Random) -> timedelta | None:
    """A per-message expiration in ``[delay * (1 - jitter), delay]``, or None without jitter.

    A delay queue is FIFO and only expires messages at its head, so a shorter expiration behind a
    longer one waits for it: jitter can only shorten a wait among messages that arrive spread out,
    which is why it is a fraction of the rung and off by default.
    """
    if jitter <= 0:
        return None
    return delay * (1.0 - jitter * rng.random())
