"""The pipeline and the settler, wired from the settings: what a delivery meets between the
broker's hands and the broker's hands again.

One function, so that the service (:func:`consumer.service.app.build_service`) and the test
harness (:mod:`consumer.testing`) run the very same parts, configured the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from uuid import UUID

from consumer.config.settings import Settings
from consumer.db.crashes import CrashLedger
from consumer.db.database import Database
from consumer.db.guard import Guard
from consumer.db.receipts import Receipts
from consumer.pipeline.batch import BatchEngine
from consumer.pipeline.calls import HandlerCaller, HandlerCalls
from consumer.pipeline.envelope_parser import EnvelopeParser
from consumer.pipeline.follow_ups import FollowUpWriter
from consumer.pipeline.handler_time import HandlerTime
from consumer.pipeline.isolated import Isolated
from consumer.pipeline.judge import Judge
from consumer.pipeline.pipeline import Pipeline
from consumer.pipeline.prepare import Preparer
from consumer.pipeline.retry import RetryPolicy
from consumer.pipeline.tracing import Tracing
from consumer.registry import HandlerRegistry
from consumer.service.components import (
    database_config,
    envelope_limits,
    names_for,
    receipt_window,
)
from consumer.service.settle import Settler
from topology.durations import to_milliseconds

__all__ = ["PipelineParts", "build_pipeline"]


@dataclass(frozen=True, slots=True)
class PipelineParts:
    """The database (not opened), the preparer, the pipeline, the settler, the crash ledger, and
    the handlers' measured time (what adaptive concurrency decides from)."""

    database: Database
    preparer: Preparer
    pipeline: Pipeline
    settler: Settler
    ledger: CrashLedger
    handler_time: HandlerTime


def build_pipeline(
    settings: Settings,
    registry: HandlerRegistry,
    *,
    calls: HandlerCalls,
    owner: UUID,
    tracing: Tracing | None = None,
    on_conflict: Callable[[], object] = lambda: None,
    queue: str | None = None,
) -> PipelineParts:
    """Prepare, batch engine, handler call, judge and settler, as ``settings`` configure them;
    ``on_conflict`` is told of each batch that met a lock conflict (a metric). ``queue``: the
    queue table's row this pipeline serves (its retries and dead letters go to its own)."""
    database = Database(database_config(settings, registry))
    guard = Guard(database, within=settings.db_stall_timeout.total_seconds())
    judge = Judge(RetryPolicy.from_delays(settings.retry_delays))
    receipts = Receipts(consumer=settings.name, guard=guard)
    handler_time = HandlerTime()
    caller = HandlerCaller(
        default_timeout=settings.handler_timeout.total_seconds(),
        calls=calls,
        handler_time=handler_time,
        follow_ups=FollowUpWriter(consumer=settings.name, handlers=registry),
    )
    ledger = CrashLedger(consumer=settings.name, owner=owner, queue=queue)
    isolated = Isolated(
        database=database,
        guard=guard,
        receipts=receipts,
        caller=caller,
        judge=judge,
        ledger=ledger,
        tracing=tracing,
    )
    parser = EnvelopeParser(envelope_limits(settings))
    preparer = Preparer(registry, parser, calls, receipt_window(settings))
    pipeline = Pipeline(
        preparer=preparer,
        engine=BatchEngine(
            database=database,
            guard=guard,
            receipts=receipts,
            caller=caller,
            judge=judge,
            isolated=isolated,
            lock_timeout_ms=to_milliseconds(settings.batch_lock_timeout),
            on_conflict=on_conflict,
            tracing=tracing,
        ),
        isolated=isolated,
        judge=judge,
        database=database,
    )
    settler = Settler(
        names=names_for(settings, queue), jitter=settings.retry_jitter, tracing=tracing
    )
    return PipelineParts(database, preparer, pipeline, settler, ledger, handler_time)
