"""Where each delivery in hand waits, and the state that decides it.

A delivery arriving while the service accepts goes to the isolated queue if it must be applied
isolated (it came back after a death or a broken connection: :mod:`consumer.service.isolated`),
else to the inbox of the worker that owns its handler's key (keyless ones in turn). While the
database is away it is held; while the service stops it is handed back. Exactly one owner at a
time: an inbox, the isolated queue, the held list, or a worker that took it.
"""

from __future__ import annotations

import asyncio
import enum
from collections.abc import Callable
from dataclasses import dataclass
from weakref import WeakKeyDictionary

from consumer.amqp.delivery import Delivery
from consumer.pipeline.outcome import Failed, Outcome
from consumer.pipeline.prepare import Preparer
from consumer.pipeline.ready import Prepared
from consumer.service.inbox import Inbox
from consumer.service.isolated import IsolatedQueue, IsolationGate
from consumer.service.memory import BATCH_BYTES, KEEP_PARSED_BYTES
from consumer.service.settle import Settler

__all__ = ["Dispatcher", "Phase", "State"]


class Phase(enum.Enum):
    """What the service does with a delivery in hand."""

    ACCEPTING = "accepting"
    """Route it to a worker."""
    PAUSED = "paused"
    """Hold it: the database cannot be reached."""
    DRAINING = "draining"
    """Give it back: the service is stopping."""


@dataclass(slots=True)
class State:
    """The service's phase, and how many times it has resumed after a pause: outcomes of work
    that began before the last resume say nothing about the database now."""

    phase: Phase = Phase.ACCEPTING
    generation: int = 0


class Dispatcher:
    """Owns the inboxes, the isolated queue and the held deliveries, and moves deliveries between
    them."""

    def __init__(
        self,
        *,
        workers: int,
        batch_size: int,
        batch_wait: float | None,
        preparer: Preparer,
        settler: Settler,
        window_full: Callable[[], bool] = lambda: False,
        isolation: IsolationGate | None = None,
    ) -> None:
        """``workers``: the most workers (an inbox each); :meth:`resize` says how many take new
        deliveries. ``batch_wait``: the most a refill is waited for (None: as measured).
        ``window_full``: the deliveries in hand fill the prefetch window, so the broker sends no
        more until one is settled and no batch should wait for another. ``isolation``: the
        process's gate, where the services of a queue table share one (else its own)."""
        self.state = State()
        self._active = workers
        self.database_down = asyncio.Event()
        self._window_full = window_full
        self.inboxes: list[Inbox[Delivery]] = [
            Inbox(
                size=batch_size,
                wait=batch_wait,
                max_weight=BATCH_BYTES,
                weight=_body_bytes,
                more_coming=lambda: not window_full(),
            )
            for _ in range(workers)
        ]
        self.isolated: IsolatedQueue[Delivery] = IsolatedQueue(isolation)
        self._held: list[Delivery] = []
        # What earlier verdicts taught of a delivery in hand: it goes isolated from now on, with
        # its connection's breaks in a row so far (forgotten with the delivery).
        self._isolated_next: WeakKeyDictionary[Delivery, int] = WeakKeyDictionary()
        self._giving_back: set[asyncio.Task[object]] = set()
        self._next_inbox = 0
        self._preparer = preparer
        self._settler = settler

    def resize(self, *, workers: int, batch_size: int) -> None:
        """From now on route to the first ``workers`` inboxes, and let batches take up to
        ``batch_size``. What waits in the inboxes is routed again: a window's worth queued for
        one worker would otherwise keep the others idle until it is through (batches under way
        stay their workers')."""
        for inbox in self.inboxes:
            inbox.size = batch_size
        active = max(1, min(workers, len(self.inboxes)))
        if active == self._active:
            return
        self._active = active
        self._next_inbox %= active
        # In inbox order, each inbox's in its order: a key's deliveries all come from one inbox,
        # so they keep their order.
        for delivery in [item for inbox in self.inboxes for item in inbox.take_all()]:
            self._to_inbox(delivery)

    @property
    def active(self) -> int:
        """The inboxes new deliveries are routed to."""
        return self._active

    def window_full(self) -> bool:
        """The deliveries in hand fill the prefetch window: the broker sends none until one is
        settled."""
        return self._window_full()

    @property
    def held(self) -> int:
        return len(self._held)

    def place_now(self, delivery: Delivery) -> None:
        """:meth:`place` for a delivery as it arrives, called from the channel's reader: it
        cannot wait, so a give-back (the service is stopping) goes out in a task of its own."""
        if not self._kept(delivery):
            task = asyncio.get_running_loop().create_task(self._settler.give_back(delivery))
            self._giving_back.add(task)
            task.add_done_callback(self._giving_back.discard)

    async def place(self, delivery: Delivery) -> None:
        """A delivery in hand: to a worker, held through a pause, or given back when stopping."""
        if not self._kept(delivery):
            await self._settler.give_back(delivery)

    def _kept(self, delivery: Delivery) -> bool:
        """Routed to a worker while accepting, held while paused; False while stopping, when
        the caller gives it back."""
        phase = self.state.phase
        if phase is Phase.ACCEPTING:
            self._route(delivery)
        elif phase is Phase.PAUSED:
            self._held.append(delivery)
        else:
            return False
        return True

    async def admit(self, deliveries: list[Delivery]) -> list[Delivery]:
        """Of the deliveries a worker took, the ones to apply now; the others are placed again,
        and those whose channel is gone let go (the broker has them back)."""
        live: list[Delivery] = []
        for delivery in deliveries:
            if not delivery.channel_open:
                continue
            if self.state.phase is Phase.ACCEPTING:
                live.append(delivery)
            else:
                await self.place(delivery)
        return live

    def pause(self, generation: int) -> bool:
        """The database went away, as work begun in ``generation`` found: hold from now on, and
        what waits in the inboxes and the isolated queue too. False if that news is stale or
        known."""
        state = self.state
        if generation != state.generation or state.phase is not Phase.ACCEPTING:
            return False
        state.phase = Phase.PAUSED
        self._held.extend(self.take_waiting())
        self.database_down.set()
        return True

    def resume(self, *, restarted: bool = False) -> int:
        """The database answers again: route what was held. Returns how many. ``restarted``: the
        server restarted meanwhile, so the connections that broke were not the events' doing."""
        state = self.state
        state.generation += 1
        state.phase = Phase.ACCEPTING
        self.database_down.clear()
        held, self._held = self._held, []
        for delivery in held:
            if restarted and delivery in self._isolated_next:
                self._isolated_next[delivery] = 0
            if delivery.channel_open:
                self._route(delivery)
        return len(held)

    async def give_back_waiting(self) -> int:
        """Stopping: hand back, once each, everything in hand that has not started."""
        self.state.phase = Phase.DRAINING
        waiting = self.take_waiting()
        for delivery in waiting:
            await self._settler.give_back(delivery)
        # And those that arrived meanwhile (place_now gave each a task): the drain goes on only
        # once every nack is in the writer's hands.
        if self._giving_back:
            await asyncio.gather(*self._giving_back, return_exceptions=True)
        return len(waiting)

    def take_waiting(self) -> list[Delivery]:
        """Every delivery in hand that no worker has started: held, isolated, in the inboxes
        (taken out; when their channel is gone, the broker has them back already)."""
        waiting = [*self._held, *self.isolated.take_all()]
        waiting += [delivery for inbox in self.inboxes for delivery in inbox.take_all()]
        self._held.clear()
        return waiting

    async def place_held(self, outcome: Outcome) -> None:
        """A delivery a worker holds for the database (its verdict held it): placed again, and
        isolated from now on if its verdict says so."""
        verdict = outcome.verdict
        if isinstance(verdict, Failed) and verdict.isolated_next:
            self._isolated_next[outcome.delivery] = verdict.connection_losses
        await self.place(outcome.delivery)

    def connection_losses(self, delivery: Delivery) -> int:
        """Times in a row ``delivery``'s connection broke while it was applied isolated."""
        return self._isolated_next.get(delivery, 0)

    def _route(self, delivery: Delivery) -> None:
        # Isolated: it came back after a death (redelivered) or a broken connection.
        if delivery.redelivered or delivery in self._isolated_next:
            self.isolated.put(delivery)
        else:
            self._to_inbox(delivery)
        if self._window_full():
            # This was the last delivery the window lets in: waiting batches go as they are.
            for inbox in self.inboxes:
                inbox.wake()

    def _to_inbox(self, delivery: Delivery) -> None:
        prepared = self._preparer.prepared(delivery)
        index: int | None = None
        if isinstance(prepared, Prepared) and (key := prepared.key()) is not None:
            # The key alone: a restock and a reserve of one SKU lock the same row.
            index = hash(key) % self._active
        if index is None:
            index = self._next_inbox
            self._next_inbox = (index + 1) % self._active
        if isinstance(prepared, Prepared) and len(delivery.body) > KEEP_PARSED_BYTES:
            # Parsed for its key only: the worker that applies it parses it again, so that the
            # prefetch holds bodies, not their many times larger objects (consumer.service.memory).
            self._preparer.forget(delivery)
        self.inboxes[index].put(delivery)


def _body_bytes(delivery: Delivery) -> int:
    return len(delivery.body)
