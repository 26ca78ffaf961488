"""A delivery is what the broker said, nothing more: what the service learns of it is kept by
whom it concerns (the preparer, the tracer, the dispatcher), and the judge changes nothing of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from consumer.amqp.delivery import Delivery
from consumer.errors import DatabaseUnavailable, TransientError
from consumer.pipeline.judge import Judge
from consumer.pipeline.outcome import Failed, Outcome
from consumer.pipeline.retry import DeadLetter, DeadLetterReason, RetryPolicy, Return
from consumer.service.dispatch import Dispatcher, Phase
from tests.support import FakeDelivery

JUDGE = Judge(RetryPolicy.from_delays([]))


def test_a_delivery_carries_the_broker_facts_only() -> None:
    assert [field.name for field in dataclasses.fields(Delivery)] == [
        "message",
        "acker",
        "headers",
        "received_at",
    ]


def test_the_judge_says_what_was_learnt_in_its_verdict_and_changes_nothing() -> None:
    delivery: Any = FakeDelivery(headers={})
    before = dict(vars(delivery))

    failed = JUDGE.failed(delivery, DatabaseUnavailable("gone"), isolated=True, connection_losses=1)

    assert vars(delivery) == before
    assert isinstance(failed.decision, Return)
    assert (failed.isolated_next, failed.connection_losses) == (True, 2)


def test_a_connection_broken_three_times_in_a_row_isolated_dead_letters_the_event() -> None:
    delivery: Any = FakeDelivery(headers={})

    failed = JUDGE.failed(delivery, DatabaseUnavailable("gone"), isolated=True, connection_losses=2)

    assert failed.decision == DeadLetter(DeadLetterReason.CONNECTION_LOST)


def test_a_failure_of_the_events_own_teaches_nothing_of_isolation() -> None:
    delivery: Any = FakeDelivery(headers={})

    failed = JUDGE.failed(delivery, TransientError("t"), connection_losses=0)

    assert (failed.isolated_next, failed.connection_losses) == (False, 0)


class _Preparer:
    def prepared(self, delivery: Any) -> None:
        return None

    def forget(self, delivery: Any) -> None:
        pass


def _dispatcher() -> Dispatcher:
    return Dispatcher(
        workers=1,
        batch_size=10,
        batch_wait=0.01,
        preparer=_Preparer(),  # type: ignore[arg-type]
        settler=None,  # type: ignore[arg-type]
    )


async def test_a_held_delivery_its_verdict_isolates_goes_isolated_after_the_pause() -> None:
    dispatcher = _dispatcher()
    delivery: Any = FakeDelivery(redelivered=False, channel_open=True, body=b"{}")
    failed = Failed(
        DatabaseUnavailable("gone"), Return(), 0, isolated_next=True, connection_losses=2
    )
    assert dispatcher.pause(dispatcher.state.generation)

    await dispatcher.place_held(Outcome(delivery, failed))
    assert dispatcher.held == 1
    dispatcher.resume()

    assert dispatcher.state.phase is Phase.ACCEPTING
    assert dispatcher.connection_losses(delivery) == 2
    assert dispatcher.isolated.take() is delivery


async def test_a_server_restart_forgives_the_connection_losses_but_keeps_it_isolated() -> None:
    dispatcher = _dispatcher()
    delivery: Any = FakeDelivery(redelivered=False, channel_open=True, body=b"{}")
    failed = Failed(
        DatabaseUnavailable("gone"), Return(), 0, isolated_next=True, connection_losses=2
    )
    dispatcher.pause(dispatcher.state.generation)
    await dispatcher.place_held(Outcome(delivery, failed))

    dispatcher.resume(restarted=True)
    await asyncio.sleep(0)

    assert dispatcher.connection_losses(delivery) == 0
    assert dispatcher.isolated.take() is delivery
