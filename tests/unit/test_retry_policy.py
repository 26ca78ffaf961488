from datetime import timedelta

import asyncpg
import pytest

from consumer.classification import ErrorKind, classify
from consumer.errors import (
    CrashedRepeatedly,
    DatabaseUnavailable,
    HandlerEndedTransaction,
    HandlerTimeout,
    HardTimeLimitExceeded,
    IdConflict,
    PermanentError,
    SwallowedDatabaseError,
    TransientError,
)
from consumer.pipeline.retry import (
    MAX_CONNECTION_LOSSES,
    DeadLetter,
    DeadLetterReason,
    Retry,
    RetryPolicy,
    Return,
)

LADDER = (timedelta(seconds=1), timedelta(seconds=5), timedelta(seconds=30))
POLICY = RetryPolicy(LADDER)


@pytest.mark.parametrize(
    ("error", "attempts", "decision"),
    [
        (TransientError("x"), 0, Retry(rung=0, delay=LADDER[0], attempt=1)),
        (TransientError("x"), 1, Retry(rung=1, delay=LADDER[1], attempt=2)),
        (TransientError("x"), 2, Retry(rung=2, delay=LADDER[2], attempt=3)),
        (TransientError("x"), 3, DeadLetter(DeadLetterReason.RETRIES_EXHAUSTED)),
        (TransientError("x"), 99, DeadLetter(DeadLetterReason.RETRIES_EXHAUSTED)),
        (TransientError("x"), -1, Retry(rung=0, delay=LADDER[0], attempt=1)),
        (HandlerTimeout("slow"), 0, Retry(rung=0, delay=LADDER[0], attempt=1)),
        (asyncpg.SerializationError("40001"), 0, Retry(rung=0, delay=LADDER[0], attempt=1)),
        (asyncpg.DeadlockDetectedError("40P01"), 2, Retry(rung=2, delay=LADDER[2], attempt=3)),
        (asyncpg.LockNotAvailableError("55P03"), 0, Retry(rung=0, delay=LADDER[0], attempt=1)),
        (TimeoutError(), 0, Retry(rung=0, delay=LADDER[0], attempt=1)),
        (ConnectionResetError(), 0, Retry(rung=0, delay=LADDER[0], attempt=1)),
        (PermanentError("rule"), 0, DeadLetter(DeadLetterReason.PERMANENT_FAILURE)),
        (ValueError("bug"), 0, DeadLetter(DeadLetterReason.PERMANENT_FAILURE)),
        (KeyError("bug"), 2, DeadLetter(DeadLetterReason.PERMANENT_FAILURE)),
        (asyncpg.UniqueViolationError("23505"), 0, DeadLetter(DeadLetterReason.PERMANENT_FAILURE)),
        (DatabaseUnavailable("down"), 0, Return()),
        (DatabaseUnavailable("down"), 3, Return()),
        (asyncpg.ConnectionDoesNotExistError("gone"), 1, Return()),
        (asyncpg.CannotConnectNowError("starting"), 0, Return()),
        (asyncpg.InternalClientError("cannot switch to state 12"), 2, Return()),
    ],
)
def test_decision_table(error: BaseException, attempts: int, decision: object) -> None:
    assert POLICY.decide(error, attempts) == decision


def test_an_empty_ladder_dead_letters_transient_failures_at_once() -> None:
    assert RetryPolicy(()).decide(TransientError("x"), 0) == DeadLetter(
        DeadLetterReason.RETRIES_EXHAUSTED
    )


def test_classification_is_by_type_not_message() -> None:
    assert classify(ValueError("connection refused")) is ErrorKind.PERMANENT
    assert classify(TransientError("permanent")) is ErrorKind.TRANSIENT


def test_a_lost_connection_returns_the_event_until_it_has_broken_too_many_in_a_row() -> None:
    policy = RetryPolicy.from_delays([timedelta(seconds=1)])
    lost = DatabaseUnavailable("the database connection was lost")
    for losses in range(MAX_CONNECTION_LOSSES):
        assert policy.decide(lost, 0, losses) == Return()
    assert policy.decide(lost, 0, MAX_CONNECTION_LOSSES) == DeadLetter(
        DeadLetterReason.CONNECTION_LOST
    )


@pytest.mark.parametrize(
    ("error", "reason"),
    [
        (SwallowedDatabaseError("x"), DeadLetterReason.PERMANENT_FAILURE),
        (HandlerEndedTransaction("x"), DeadLetterReason.PERMANENT_FAILURE),
        (HardTimeLimitExceeded("x"), DeadLetterReason.HARD_TIME_LIMIT),
        (CrashedRepeatedly("x"), DeadLetterReason.CRASHED),
        (IdConflict.between("id", "a.b", "c.d"), DeadLetterReason.ID_CONFLICT),
    ],
)
def test_a_permanent_error_carries_its_dead_letter_reason(
    error: Exception, reason: DeadLetterReason
) -> None:
    policy = RetryPolicy.from_delays([timedelta(seconds=1)])
    assert policy.decide(error, 0) == DeadLetter(reason)


class _Declined(PermanentError):
    """A handler's business error with a ``reason`` of its own (found in review: it raised
    ValueError inside the judge and killed the worker)."""

    def __init__(self, reason: object) -> None:
        super().__init__(f"declined: {reason}")
        self.reason = reason  # type: ignore[assignment]


@pytest.mark.parametrize("reason", ["card_declined", ["a", "list"], None])
def test_a_reason_of_a_handlers_own_is_a_permanent_failure(reason: object) -> None:
    policy = RetryPolicy.from_delays([timedelta(seconds=1)])
    decision = policy.decide(_Declined(reason), 0)
    assert decision == DeadLetter(DeadLetterReason.PERMANENT_FAILURE)
