"""What handlers publish (``event.publish``), written to the outbox in their own transaction.

Each handler call starts with an empty :class:`~consumer.outbox.Publishes` per event, so a call
made again (after a rollback, or in a batch re-applied without its culprit) collects afresh, and
its derived ids come out the same. The rows are written, in one statement, only when the call
returned with the transaction still open (within the handler's time limit, as its own statements
are), and only for the events it applied: a call that raised, or a batch handler's event it
reported failed, writes nothing. A row written and then rolled back (the batch failed later, the
savepoint was rolled back) goes with the rest.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import asyncpg

from consumer.envelope import set_follow_ups
from consumer.errors import PipelineFault
from consumer.outbox import Publishes, write_rows
from consumer.pipeline.ready import Ready
from consumer.registry import Handler

__all__ = ["FollowUpWriter"]


class FollowUpWriter:
    """Opens each handler call's collections and writes what the call published."""

    def __init__(self, *, consumer: str, handlers: Mapping[str, Handler]) -> None:
        """``consumer``: ``CONSUMER_NAME``, part of each derived id and the rows'
        ``caused_by_consumer``; ``handlers``: the service's, which check what is published to
        their types."""
        self._consumer = consumer
        self._handlers = handlers

    def open(self, items: Sequence[Ready]) -> list[Publishes]:
        """An empty collection for each event of a call, where its ``publish`` adds."""
        opened = []
        for item in items:
            publishes = Publishes(item.event, consumer=self._consumer, handlers=self._handlers)
            set_follow_ups(item.event, publishes)
            opened.append(publishes)
        return opened

    @staticmethod
    def close(items: Sequence[Ready]) -> None:
        """After the call: a ``publish`` now (a task the handler left running) raises."""
        for item in items:
            set_follow_ups(item.event, None)

    async def write(self, conn: asyncpg.Connection[Any], applied: Iterable[Publishes]) -> None:
        """The rows of the events ``applied``, in one statement (none without a row). Not under
        the service's stall guard: the caller runs it within the handler's time limit."""
        rows = [row for publishes in applied for row in publishes.rows]
        if not rows:
            return
        try:
            await write_rows(conn, rows)
        except (asyncpg.CheckViolationError, asyncpg.UndefinedTableError) as error:
            # No partition for now (their upkeep has failed for days) or no table: the
            # service's fault, not the event's, so stop rather than dead-letter every event that
            # publishes; a start makes the partitions before it consumes.
            raise PipelineFault(f"cannot write outbox rows: {error}") from error
