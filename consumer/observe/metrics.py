"""Prometheus metrics, registered on a registry that is passed in (never the global one).

Labels stay low-cardinality: event types come from the registered handlers only (anything else is
``unknown``), outcomes and reasons are fixed sets, rungs are the configured ladder.

The process's own ``process_*`` and ``python_info`` series are registered on the same registry:
``process_start_time_seconds`` is the restart signal the alerts read.
"""

from __future__ import annotations

import platform
from collections.abc import Callable, Iterable, Iterator
from datetime import timedelta
from typing import Any

from prometheus_client import (
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
)
from prometheus_client.metrics_core import Metric

from consumer.db.retention import ReceiptWindow
from consumer.errors import PoisonReason
from consumer.pipeline.outcome import OutcomeKind
from consumer.pipeline.retry import DeadLetterReason
from consumer.version import __version__

__all__ = ["UNKNOWN_TYPE", "Metrics", "ServiceRegistry"]

UNKNOWN_TYPE = "unknown"

_DURATION_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 15, 20)
_LAG_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)


class ServiceRegistry(CollectorRegistry):
    """A registry whose exposition leaves out the ``*_created`` samples.

    prometheus_client adds one beside every counter and histogram child, a series of its own
    that nothing here reads (``increase()`` works from the counters). Its only switch,
    ``disable_created_metrics()``, is global to the process and would reach every other
    registry; dropping the samples when this registry is collected, at scrape time, reaches
    only this one and costs nothing per event.
    """

    def collect(self) -> Iterator[Metric]:
        for metric in super().collect():
            created = f"{metric.name}_created"
            # Every collect builds fresh Metric objects: filtering in place touches no state.
            metric.samples = [sample for sample in metric.samples if sample.name != created]
            yield metric


class Metrics:
    """Every metric the service exports, named ``consumer_*``, and the process's own."""

    def __init__(
        self,
        registry: CollectorRegistry,
        event_types: Iterable[str],
        rungs: Iterable[str] = (),
        *,
        name: str = "consumer",
    ) -> None:
        self.registry = registry
        ProcessCollector(registry=registry)
        PlatformCollector(registry=registry)
        self._known_types = frozenset(event_types)
        # Resolved label children, by labels: one line per message passes here.
        self._message_children: dict[tuple[str, OutcomeKind], Any] = {}
        self._handler_children: dict[str, Any] = {}
        self._lag_children: dict[str, Any] = {}
        self.messages = Counter(
            "consumer_messages_total",
            "Messages by event type and outcome.",
            ["type", "outcome"],
            registry=registry,
        )
        self.handler_duration = Histogram(
            "consumer_handler_duration_seconds",
            "Time spent in the handler, inside the transaction.",
            ["type"],
            buckets=_DURATION_BUCKETS,
            registry=registry,
        )
        self.lag = Histogram(
            "consumer_event_lag_seconds",
            "From the event's occurred_at to the commit of its effect.",
            ["type"],
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.in_flight = Gauge(
            "consumer_in_flight",
            "Deliveries received on the current channel and not yet acked or nacked.",
            registry=registry,
        )
        self.settled_twice = Counter(
            "consumer_settled_twice",
            "Acks or nacks not sent because their delivery was already settled (a bug: always 0).",
            registry=registry,
        )
        self.retries = Counter(
            "consumer_retries_published_total",
            "Copies published to a retry rung, by rung.",
            ["rung"],
            registry=registry,
        )
        self.redeliveries = Counter(
            "consumer_redeliveries_total",
            "Deliveries the broker flagged as redelivered.",
            registry=registry,
        )
        # Counted where the service decides them (published dead letters, poison). The
        # broker's own delivery_limit dead letters never come back to the service as a verdict:
        # RabbitMQ counts them (rabbitmq_global_messages_dead_lettered_delivery_limit_total),
        # which the alerts read beside this one, so nothing is counted twice.
        self.dead_letters = Counter(
            "consumer_dead_letters_total",
            "Messages sent to the dead-letter exchange, by reason.",
            ["reason"],
            registry=registry,
        )
        self.publish_failures = Counter(
            "consumer_publish_failures_total",
            "Retry or dead-letter publishes not confirmed (the original was returned).",
            registry=registry,
        )
        self.settle_lost = Counter(
            "consumer_settle_lost_total",
            "Acks or nacks not sent because their channel had closed (the broker redelivers).",
            registry=registry,
        )
        self.batch_conflicts = Counter(
            "consumer_batch_conflicts_total",
            "Batches that ran into another transaction's row locks and went round again.",
            registry=registry,
        )
        self.schema_missing = Counter(
            "consumer_schema_missing_total",
            "Events whose handler met a table or column not there (yet): a migration not run "
            "before the code that needs it. Retried through the ladder.",
            ["type"],
            registry=registry,
        )
        self.broker_connected = Gauge(
            "consumer_broker_connected", "1 while connected to RabbitMQ.", registry=registry
        )
        self.consuming = Gauge(
            "consumer_consuming",
            "1 while a consumer is registered on the work queue.",
            registry=registry,
        )
        self.paused = Gauge(
            "consumer_paused",
            "1 while consumption is paused because the database cannot be reached.",
            registry=registry,
        )
        self.pool_in_use = Gauge(
            "consumer_db_pool_in_use", "Database connections checked out.", registry=registry
        )
        self.pool_size = Gauge(
            "consumer_db_pool_size", "Database connections open in the pool.", registry=registry
        )
        self.pool_max = Gauge(
            "consumer_db_pool_max",
            "The most connections the pool opens (CONSUMER_DB_POOL_SIZE).",
            registry=registry,
        )
        self.workers = Gauge(
            "consumer_workers",
            "Workers taking new deliveries, each applying one batch at a time on a connection "
            "of its own: chosen from the handlers' measured time unless CONSUMER_WORKERS pins it.",
            registry=registry,
        )
        self.batch_size = Gauge(
            "consumer_batch_size",
            "The most events a batch (one transaction) takes: chosen from the handlers' "
            "measured time unless CONSUMER_BATCH_SIZE pins it.",
            registry=registry,
        )
        self.concurrency_changes = Counter(
            "consumer_concurrency_changes_total",
            "Times the worker count or batch size was changed after the handlers' measured time.",
            registry=registry,
        )
        self.receipt_prunes = Counter(
            "consumer_receipt_prunes_total",
            "Receipt pruning rounds this replica ran (it held the lock).",
            registry=registry,
        )
        self.receipt_prune_failures = Counter(
            "consumer_receipt_prune_failures_total",
            "Receipt pruning rounds that failed (a lock not had in time, the database away).",
            registry=registry,
        )
        self.clock_ahead = Gauge(
            "consumer_clock_ahead_seconds",
            "How far this host's clock is ahead of the database's (negative: behind), measured "
            "at start-up and on every receipt pruning round (CONSUMER_MAX_CLOCK_SKEW).",
            registry=registry,
        )
        self.receipts_oldest_age = Gauge(
            "consumer_receipts_oldest_age_seconds",
            "Age of the oldest receipt range kept: no receipt kept is older.",
            registry=registry,
        )
        self.receipts_rows = Gauge(
            "consumer_receipts_rows",
            "Receipts kept, estimated from the planner's statistics.",
            registry=registry,
        )
        self.receipts_partitions = Gauge(
            "consumer_receipts_partitions", "Receipt partitions kept.", registry=registry
        )
        self.receipts_prune_late_after = Gauge(
            "consumer_receipts_prune_late_after_seconds",
            "The oldest a receipt range may get before pruning counts as behind: the retention, "
            "a partition and two prune intervals.",
            registry=registry,
        )
        self.outbox_depth = Gauge(
            "consumer_outbox_depth",
            "Outbox rows committed and not yet sent (nor refused for good), as the relay last "
            "counted them.",
            registry=registry,
        )
        self.outbox_oldest_age = Gauge(
            "consumer_outbox_oldest_age_seconds",
            "Age of the oldest outbox row not yet sent (the database's clock); 0 when none is.",
            registry=registry,
        )
        self.outbox_publish_latency = Histogram(
            "consumer_outbox_publish_latency_seconds",
            "From an outbox row's created_at (the database's clock: its transaction's start) to "
            "the broker's confirm of its publish by the relay.",
            buckets=_LAG_BUCKETS,
            registry=registry,
        )
        self.outbox_published = Counter(
            "consumer_outbox_published_total",
            "Outbox rows the relay published and the broker confirmed.",
            registry=registry,
        )
        self.outbox_refused = Counter(
            "consumer_outbox_refused_total",
            "Outbox publishes that failed: transient (nacked, no confirm, the connection gone: "
            "tried again) or permanent (unroutable: the row's failed_at set).",
            ["kind"],
            registry=registry,
        )
        self.outbox_relay_errors = Counter(
            "consumer_outbox_relay_errors_total",
            "Relay rounds or LISTEN connections lost to a database error (tried again with "
            "backoff).",
            registry=registry,
        )
        self.build_info = Gauge(
            "consumer_build_info",
            "Always 1; the labels say what is running.",
            ["version", "python"],
            registry=registry,
        )
        self.build_info.labels(version=__version__, python=platform.python_version()).set(1)
        # The alerts and the dashboard find the service's queues (<name>.work, <name>.dead, ...)
        # in RabbitMQ's metrics from this label: nothing in them is hard-coded to one name.
        self.service_info = Gauge(
            "consumer_service_info",
            "Always 1; name is CONSUMER_NAME, the prefix of the service's queues.",
            ["name"],
            registry=registry,
        )
        self.service_info.labels(name=name).set(1)
        self._create_series(rungs)

    def _create_series(self, rungs: Iterable[str]) -> None:
        """Every known label combination starts at 0: ``increase()`` cannot see a first 1."""
        for event_type in (*self._known_types, UNKNOWN_TYPE):
            for outcome in OutcomeKind:
                self.messages.labels(type=event_type, outcome=outcome.value)
        for reason in (*DeadLetterReason, *PoisonReason):
            self.dead_letters.labels(reason=reason.value)
        for rung in rungs:
            self.retries.labels(rung=rung)
        for kind in ("transient", "permanent"):
            self.outbox_refused.labels(kind=kind)

    def type_label(self, event_type: str | None) -> str:
        """The event type if a handler is registered for it, else ``unknown`` (bounded labels)."""
        return event_type if event_type in self._known_types else UNKNOWN_TYPE

    def count(self, event_type: str | None, outcome: OutcomeKind) -> None:
        key = (self.type_label(event_type), outcome)
        child = self._message_children.get(key)
        if child is None:
            child = self._message_children[key] = self.messages.labels(key[0], outcome.value)
        child.inc()

    def observe_handler(self, type_label: str, seconds: float) -> None:
        child = self._handler_children.get(type_label)
        if child is None:
            child = self._handler_children[type_label] = self.handler_duration.labels(type_label)
        child.observe(seconds)

    def observe_lag(self, type_label: str, seconds: float) -> None:
        child = self._lag_children.get(type_label)
        if child is None:
            child = self._lag_children[type_label] = self.lag.labels(type_label)
        child.observe(seconds)

    def describe_receipt_window(
        self, window: ReceiptWindow, *, widest: timedelta | None = None
    ) -> None:
        self.receipts_prune_late_after.set(window.late_after(widest).total_seconds())

    def observe_receipts(self, partitions: int, rows: int, oldest_age: float | None) -> None:
        self.receipts_partitions.set(partitions)
        self.receipts_rows.set(rows)
        self.receipts_oldest_age.set(oldest_age or 0.0)

    def watch_pool(self, size: Callable[[], int], in_use: Callable[[], int], max_size: int) -> None:
        """Read the pool's numbers at scrape time."""
        self.pool_size.set_function(size)
        self.pool_in_use.set_function(in_use)
        self.pool_max.set(max_size)
