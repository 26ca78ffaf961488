"""Where the dispatcher puts a delivery, and whom it tells."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

from consumer.dispatch import Dispatcher


class _Keyless:
    def prepared(self, delivery: Any) -> None:
        return None  # no key: round robin


def _delivery(*, isolated: bool) -> Any:
    return SimpleNamespace(isolated=isolated, body=b"{}", prepared=None, channel_open=True)


async def test_an_isolated_delivery_that_fills_the_window_wakes_waiting_batches() -> None:
    # The last delivery the window lets in went to the lane: nothing more comes for the inbox
    in_hand = 0
    dispatcher = Dispatcher(
        workers=1,
        batch_size=10,
        batch_wait=30.0,
        preparer=_Keyless(),  # type: ignore[arg-type]
        settler=None,  # type: ignore[arg-type]
        window_full=lambda: in_hand >= 3,
    )
    taking = asyncio.create_task(dispatcher.inboxes[0].next_batch(refill_due=True))
    await asyncio.sleep(0.01)
    for isolated in (False, False, True):
        in_hand += 1
        dispatcher._route(_delivery(isolated=isolated))
        await asyncio.sleep(0.01)
    batch = await asyncio.wait_for(taking, 10)  # not the 30 s wait
    assert len(batch) == 2
    assert dispatcher.lane.take() is not None
