"""From deliveries to verdicts: prepare each, apply them, judge what failed.

::

    prepare (parse, validate, bind to the handler) --invalid--> Rejected (poison)
    the batch engine: receipts + handlers in one transaction, committed --> Applied
                                                         a handler failed --> Failed (the policy)

Two copies of one event in a batch are applied once: the later copy takes the first one's
verdict; an event of another type with the same id is applied after them (its receipt check
finds the id conflict). A delivery that came back after a process died or its connection broke is
applied isolated, marked in progress (:meth:`Pipeline.process_isolated`). Nothing here talks to
the broker: :mod:`consumer.service.settle` turns verdicts into acks and publishes.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import UTC, datetime
from uuid import UUID

from consumer.amqp.delivery import Delivery
from consumer.amqp.headers import attempts_so_far
from consumer.classification import timed_out
from consumer.db.database import Database
from consumer.errors import CrashedRepeatedly, DatabaseUnavailable, HardTimeLimitExceeded, Poison
from consumer.pipeline.batch import BatchEngine
from consumer.pipeline.isolated import Isolated
from consumer.pipeline.judge import Judge
from consumer.pipeline.outcome import Applied, Failed, Outcome, Rejected, Verdict
from consumer.pipeline.prepare import Preparer
from consumer.pipeline.ready import Ready
from consumer.pipeline.retry import Retry

__all__ = ["Pipeline"]


class Pipeline:
    """Applies deliveries to the database and returns one :class:`Outcome` per delivery."""

    def __init__(
        self,
        *,
        preparer: Preparer,
        engine: BatchEngine,
        isolated: Isolated,
        judge: Judge,
        database: Database,
    ) -> None:
        self._preparer = preparer
        self._engine = engine
        self._isolated = isolated
        self._judge = judge
        self._database = database

    async def process(self, deliveries: Sequence[Delivery]) -> list[Outcome]:
        """Verdicts for ``deliveries``, in their order."""
        outcomes: dict[int, Outcome] = {}
        ready: list[tuple[int, Ready]] = []
        first_copy: dict[UUID, int] = {}
        later_copies: list[tuple[int, Ready, int]] = []
        others: list[int] = []
        for index, delivery in enumerate(deliveries):
            prepared = self._preparer.prepared(delivery)
            if isinstance(prepared, Poison):
                outcomes[index] = Outcome(delivery, Rejected(prepared))
                continue
            item = Ready(delivery, prepared.handler, prepared.event)
            first = first_copy.get(item.event.event_id)
            if first is not None:
                if item.event.type != ready[first][1].event.type:
                    # Another event with this id, not a copy: applied after this batch, it meets
                    # the receipt the first left (an id conflict), or none if the first failed.
                    others.append(index)
                else:
                    later_copies.append((index, item, first))
                continue
            first_copy[item.event.event_id] = len(ready)
            ready.append((index, item))
        if ready:
            items = [item for _, item in ready]
            verdicts = await self._unless_stalled(items, await self._engine.apply(items))
            for (index, item), verdict in zip(ready, verdicts, strict=True):
                outcomes[index] = Outcome(item.delivery, verdict, item.event, item.handler_seconds)
            for index, item, first in later_copies:
                verdict = _later_copy(verdicts[first], attempts_so_far(item.delivery.headers))
                outcomes[index] = Outcome(item.delivery, verdict, item.event)
        if others:
            after = await self.process([deliveries[index] for index in others])
            outcomes.update(zip(others, after, strict=True))
        return [outcomes[index] for index in range(len(deliveries))]

    async def process_isolated(self, delivery: Delivery, *, connection_losses: int = 0) -> Outcome:
        """The verdict for a delivery applied isolated, marked in progress
        (:mod:`consumer.db.crashes`): it came back after a process died or its database connection
        broke (``connection_losses`` times in a row so far). The mark is taken before any of the
        handler's code runs, its payload model's validators included; the body is decoded once."""
        identified = self._preparer.identified(delivery)
        if isinstance(identified, Poison):
            return Outcome(delivery, Rejected(identified))
        envelope = identified.envelope
        mark = await self._isolated.mark(delivery, envelope.event_id, connection_losses)
        if isinstance(mark, Failed):
            return Outcome(delivery, mark, envelope)
        conviction = mark.conviction()
        if conviction is not None:
            # Dead-lettered without running again; the mark goes once the copy is confirmed.
            failed = self._judge.failed(delivery, conviction, connection_losses=connection_losses)
            return Outcome(delivery, failed, envelope)
        prepared = self._preparer.prepared(delivery, identified)
        if isinstance(prepared, Poison):
            await self._isolated.clear(envelope.event_id)
            return Outcome(delivery, Rejected(prepared))
        item = Ready(
            delivery, prepared.handler, prepared.event, connection_losses=connection_losses
        )
        (verdict,) = await self._unless_stalled([item], [await self._isolated.apply_marked(item)])
        if isinstance(verdict, Failed):
            # Its transaction, which deletes the mark, may not have committed (a broken
            # connection). This process lived: a mark left now would count its later death,
            # of anything, against this event.
            await self._isolated.clear(envelope.event_id)
        return Outcome(delivery, verdict, item.event, item.handler_seconds)

    async def dead_lettered(self, outcome: Outcome) -> None:
        """A copy of ``outcome``'s event is confirmed in the dead-letter queue: a conviction's
        mark can go now (before, a refused copy would have let the culprit run again)."""
        verdict = outcome.verdict
        if isinstance(verdict, Failed) and _convicted(verdict.error) and outcome.event is not None:
            await self._isolated.clear(outcome.event.event_id)

    async def _unless_stalled(self, items: list[Ready], verdicts: list[Verdict]) -> list[Verdict]:
        """A handler that timed out may have waited on a database that stopped answering (a
        frozen server, a network partition): ask it now, and judge such events again knowing."""
        if not any(isinstance(v, Failed) and timed_out(v.error) for v in verdicts):
            return verdicts
        try:
            await self._database.probe()
        except DatabaseUnavailable as down:
            return [
                self._judge.stalled(item.delivery, verdict.error, down, item.connection_losses)
                if isinstance(verdict, Failed) and timed_out(verdict.error)
                else verdict
                for item, verdict in zip(items, verdicts, strict=True)
            ]
        return verdicts


def _convicted(error: BaseException) -> bool:
    return isinstance(error, HardTimeLimitExceeded | CrashedRepeatedly)


def _later_copy(first: Verdict, attempts: int) -> Verdict:
    """The verdict on a second copy of an event, in the batch of its first copy: a duplicate
    where the first committed or goes on along the ladder, else the first's fate."""
    if isinstance(first, Applied):
        return Applied(True, first.committed_at)
    if isinstance(first, Failed):
        if isinstance(first.decision, Retry):
            return Applied(True, datetime.now(UTC))
        return Failed(first.error, first.decision, attempts)
    return first
