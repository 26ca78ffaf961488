"""Where the dispatcher puts a delivery, and whom it tells."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from consumer.service.dispatch import Dispatcher, Phase


class _Keyless:
    def prepared(self, delivery: Any) -> None:
        return None  # no key: round robin

    def forget(self, delivery: Any) -> None:
        pass


class _Delivery:
    """What the dispatcher reads of a delivery; compared by identity, as a real one."""

    def __init__(self, *, redelivered: bool) -> None:
        self.redelivered = redelivered
        self.body = b"{}"
        self.channel_open = True
        self.settling_s = 0.0


def _delivery(*, isolated: bool) -> Any:
    return _Delivery(redelivered=isolated)


def _dispatcher(*, batch_wait: float, settler: Any, window_full: Any) -> Dispatcher:
    return Dispatcher(
        workers=1,
        batch_size=10,
        batch_wait=batch_wait,
        preparer=_Keyless(),  # type: ignore[arg-type]
        settler=settler,
        window_full=window_full,
    )


async def test_an_isolated_delivery_that_fills_the_window_wakes_waiting_batches() -> None:
    # The last delivery the window lets in went to the isolated queue: nothing more comes for the
    # inbox
    in_hand = 0
    dispatcher = _dispatcher(batch_wait=30.0, settler=None, window_full=lambda: in_hand >= 3)
    inbox = dispatcher.inboxes[0]
    inbox._max_linger = inbox._min_gap_wait = 30.0  # a refill waited for, however slow
    taking = asyncio.create_task(inbox.next_batch(refill_due=True, batch_seconds=30.0))
    await asyncio.sleep(0.01)
    for isolated in (False, False, True):
        in_hand += 1
        dispatcher._route(_delivery(isolated=isolated))
        await asyncio.sleep(0.01)
    batch = await asyncio.wait_for(taking, 10)  # not the 30 s wait
    assert len(batch) == 2
    assert dispatcher.isolated.take() is not None


class _SlowSettler:
    def __init__(self) -> None:
        self.given_back: list[Any] = []

    async def give_back(self, delivery: Any) -> None:
        await asyncio.sleep(delivery.settling_s)
        self.given_back.append(delivery)


async def test_a_delivery_arriving_while_draining_is_given_back_before_the_drain_goes_on() -> None:
    settler = _SlowSettler()
    dispatcher = _dispatcher(batch_wait=0.01, settler=settler, window_full=lambda: False)
    waiting = _delivery(isolated=False)
    waiting.settling_s = 0.01
    dispatcher._route(waiting)
    draining = asyncio.create_task(dispatcher.give_back_waiting())
    await asyncio.sleep(0)
    # From the channel's reader, after the drain began (a consumer the broker did not cancel)
    late = _delivery(isolated=False)
    late.settling_s = 0.2
    dispatcher.place_now(late)
    assert await draining == 1
    assert settler.given_back == [waiting, late]


class _Settler:
    def __init__(self) -> None:
        self.given_back: list[Any] = []

    async def give_back(self, delivery: Any) -> None:
        self.given_back.append(delivery)


def _where(dispatcher: Dispatcher, settler: _Settler, delivery: Any) -> str:
    if delivery in dispatcher.inboxes[0].take_all():
        return "inbox"
    if delivery in dispatcher.take_waiting():
        return "held"
    return "given back" if delivery in settler.given_back else "lost"


@pytest.mark.parametrize(
    ("phase", "place"),
    [(Phase.ACCEPTING, "inbox"), (Phase.PAUSED, "held"), (Phase.DRAINING, "given back")],
)
async def test_placing_as_it_arrives_or_later_ends_in_the_same_place(
    phase: Phase, place: str
) -> None:
    for placing_now in (True, False):
        settler = _Settler()
        dispatcher = _dispatcher(batch_wait=0.01, settler=settler, window_full=lambda: False)
        dispatcher.state.phase = phase
        delivery = _delivery(isolated=False)

        if placing_now:
            dispatcher.place_now(delivery)
            await asyncio.gather(*dispatcher._giving_back)
        else:
            await dispatcher.place(delivery)

        assert _where(dispatcher, settler, delivery) == place


async def test_more_workers_share_what_waits_for_one() -> None:
    dispatcher = Dispatcher(
        workers=4,
        batch_size=50,
        batch_wait=None,
        preparer=_Keyless(),  # type: ignore[arg-type]
        settler=None,  # type: ignore[arg-type]
    )
    dispatcher.resize(workers=1, batch_size=50)
    deliveries = [_delivery(isolated=False) for _ in range(8)]
    for delivery in deliveries:
        dispatcher._route(delivery)
    assert [len(inbox) for inbox in dispatcher.inboxes] == [8, 0, 0, 0]
    dispatcher.resize(workers=4, batch_size=5)
    assert [len(inbox) for inbox in dispatcher.inboxes] == [2, 2, 2, 2]
    assert all(inbox.size == 5 for inbox in dispatcher.inboxes)
    # Nothing lost nor doubled, and each inbox keeps arrival order.
    taken = [item for inbox in dispatcher.inboxes for item in inbox.take_all()]
    assert sorted(map(id, taken)) == sorted(map(id, deliveries))
