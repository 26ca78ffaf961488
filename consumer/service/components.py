"""Each component's part of the configuration, read from the settings in one place.

Components take their own small frozen configuration (a broker's addresses and TLS files, a
database's DSN and pool, the envelope's limits, the topology's spec), never the whole
:class:`~consumer.config.settings.Settings`: what a component can see is what it uses, and a test
can build one without the environment.
"""

from __future__ import annotations

from collections.abc import Iterable
from datetime import timedelta

from pydantic import SecretStr

from consumer.amqp.connect import BrokerConfig
from consumer.config.queue_table import QueueTable
from consumer.config.settings import Settings, split_urls
from consumer.config.tls import TlsFiles
from consumer.db.database import DatabaseConfig
from consumer.db.retention import ReceiptWindow
from consumer.pipeline.envelope_parser import EnvelopeLimits
from consumer.registry import HandlerRegistry
from consumer.service.concurrency_policy import MAX_BATCH_SIZE, Limits
from consumer.service.memory import MemoryBudget
from consumer.service.outbox_relay import RelayConfig
from topology.model import Topology
from topology.names import Names
from topology.plan import TopologySpec, build_topology

__all__ = [
    "MAX_BATCH_SIZE",
    "batch_size",
    "batch_wait",
    "broker_config",
    "concurrency_limits",
    "database_config",
    "envelope_limits",
    "idle_in_transaction_timeout",
    "max_workers",
    "memory_budget",
    "names_for",
    "receipt_window",
    "relay_config",
    "table_specs",
    "table_topology",
    "topology_for",
    "topology_spec",
    "worker_count",
]


def concurrency_limits(settings: Settings, *, per_event_handlers: bool = False) -> Limits:
    """What bounds the worker count and batch size chosen as the service runs
    (:mod:`consumer.service.concurrency_policy`), and what pins them. ``per_event_handlers``:
    whether every handler is one (the start differs)."""
    return Limits(
        prefetch=settings.prefetch,
        pool_size=settings.db_pool_size,
        workers=settings.workers,
        batch_size=settings.batch_size,
        per_event_handlers=per_event_handlers,
    )


def worker_count(settings: Settings) -> int:
    """The workers the service starts with unless every handler is a per-event one (then it
    starts at :attr:`~consumer.service.concurrency_policy.Limits.max_workers`:
    :func:`~consumer.service.concurrency_policy.initial`): ``CONSUMER_WORKERS``, or one per
    :data:`~consumer.service.concurrency_policy.WINDOW_PER_WORKER` (400) of the prefetch window,
    at least one and at most ``CONSUMER_DB_POOL_SIZE``: one at the default prefetch of 400.

    Fewer, fuller transactions beat more, smaller ones for batch and database-only handlers: a
    transaction's round trips cost about the same for one event as for fifty, and the process is
    one core's worth of CPU. Handlers that await I/O get more as the service runs, unless
    ``CONSUMER_WORKERS`` is set (:mod:`consumer.service.concurrency_policy`)."""
    return concurrency_limits(settings).base_workers


def batch_size(settings: Settings) -> int:
    """The batch size batch handlers start with: ``CONSUMER_BATCH_SIZE``, or the workers' share of
    the prefetch window, at most :data:`MAX_BATCH_SIZE`: a batch never waits for deliveries the
    window cannot hold."""
    return concurrency_limits(settings).full_batch(worker_count(settings))


def batch_wait(settings: Settings) -> float | None:
    """``CONSUMER_BATCH_WAIT`` in seconds, the most a batch waits for a full window's refill;
    None (unset): as measured (:class:`consumer.service.inbox.Inbox`)."""
    return settings.batch_wait.total_seconds() if settings.batch_wait is not None else None


def max_workers(settings: Settings) -> int:
    """The most workers the service may run: ``CONSUMER_WORKERS`` or ``CONSUMER_DB_POOL_SIZE``."""
    return concurrency_limits(settings).max_workers


def names_for(settings: Settings, queue: str | None = None) -> Names:
    """The broker names of the service, or of one ``queue`` of its queue table."""
    return Names(
        service=settings.name,
        ingress=settings.exchange,
        work_version=settings.work_queue_version,
        queue=queue,
    )


def topology_spec(
    settings: Settings, event_types: Iterable[str], queue: str | None = None, shards: int = 1
) -> TopologySpec:
    """What this service's plan depends on, its handlers' event types among it; with ``queue``,
    the plan of that queue of the table (``settings`` then the queue's own, ``shards`` its
    shard count)."""
    return TopologySpec(
        names=names_for(settings, queue),
        retry_delays=settings.retry_delays,
        delivery_limit=settings.delivery_limit,
        event_types=tuple(event_types),
        quorum_group_size=settings.quorum_initial_group_size,
        ack_timeout=settings.ack_timeout,
        shards=shards,
    )


def topology_for(settings: Settings, event_types: Iterable[str]) -> Topology:
    """The plan for this service, its handlers' event types bound to its work queue."""
    return build_topology(topology_spec(settings, event_types))


def table_specs(table: QueueTable) -> list[TopologySpec]:
    """What the plan of each queue of the table depends on, in the table's order."""
    return [
        topology_spec(queue.settings, queue.types, queue.name, queue.shards)
        for queue in table.queues
    ]


def table_topology(table: QueueTable) -> Topology:
    """The plan of every queue of the table: each its own work queue (or shards), retry ladder
    and dead-letter queue, named after it, and its event types bound to its work queue."""
    return Topology.merge(build_topology(spec) for spec in table_specs(table))


def broker_config(settings: Settings) -> BrokerConfig:
    tls = None
    if settings.amqp_uses_tls:
        tls = TlsFiles(
            ca_file=settings.amqp_ca_file,
            cert_file=settings.amqp_cert_file,
            key_file=settings.amqp_key_file,
            verify_hostname=settings.amqp_verify_hostname,
        )
    return BrokerConfig(
        urls=tuple(SecretStr(url) for url in split_urls(settings.amqp_url.get_secret_value())),
        safe_url=settings.safe_amqp_url,
        tls=tls,
        service=settings.name,
        prefetch=settings.prefetch,
        publish_timeout=settings.publish_timeout.total_seconds(),
        fast_path=settings.amqp_fast_path,
        max_body_bytes=settings.max_body_bytes,
        header_limits=envelope_limits(settings).header_tables(),
    )


def database_config(settings: Settings, registry: HandlerRegistry | None = None) -> DatabaseConfig:
    """The database's part; with the ``registry`` (the service, not a command), its sessions end
    a transaction left idle past :func:`idle_in_transaction_timeout`."""
    # Handlers run under the soft time limit; this only stops a hung server holding a
    # connection for ever.
    command_timeout = settings.hard_timeout.total_seconds() * 3
    return DatabaseConfig(
        url=settings.database_url,
        safe_url=settings.safe_database_url,
        sslmode=settings.database_sslmode,
        sslrootcert=settings.database_sslrootcert,
        pool_size=settings.db_pool_size,
        command_timeout=command_timeout,
        application_name=settings.name,
        idle_in_transaction_timeout=(
            idle_in_transaction_timeout(settings, registry) if registry is not None else None
        ),
    )


def idle_in_transaction_timeout(settings: Settings, registry: HandlerRegistry) -> float:
    """Seconds a session of the service may sit idle inside a transaction before the server ends
    it: a client that went silent mid-transaction (a partition, a frozen process) holds its row
    locks no longer. The longest a live service leaves its transaction idle is a handler awaiting
    something else than the database, up to its time limit: twice the longest limit, and never
    less than the statements' own timeout (three hard time limits: 60s by default)."""
    limits = [settings.handler_timeout]
    limits += [
        handler.timeout for handler in map(registry.__getitem__, registry) if handler.timeout
    ]
    longest = max(limits).total_seconds()
    return max(settings.hard_timeout.total_seconds() * 3, 2 * longest)


def relay_config(settings: Settings, registry: HandlerRegistry) -> RelayConfig:
    """The outbox relay's part. A round waits for its confirms inside its transaction, sending
    no statement, for at most three confirms' time, and never more than half the time after which
    the server ends a session idle in a transaction: ended before its mark, a slow round would be
    made again, the same rows published again, for ever."""
    return RelayConfig(
        exchange=settings.exchange,
        batch_size=settings.outbox_batch_size,
        poll=settings.outbox_poll.total_seconds(),
        reconnect_max_delay=settings.reconnect_max_delay.total_seconds(),
        statement_timeout=settings.hard_timeout.total_seconds() * 3,
        publish_limit=min(
            settings.publish_timeout.total_seconds() * 3,
            idle_in_transaction_timeout(settings, registry) / 2,
        ),
        stop_grace=settings.publish_timeout.total_seconds(),
        max_body_bytes=settings.max_body_bytes,
    )


def envelope_limits(settings: Settings) -> EnvelopeLimits:
    return EnvelopeLimits(
        max_bytes=settings.max_body_bytes,
        max_depth=settings.max_json_depth,
        max_containers=settings.max_json_containers,
        max_header_bytes=settings.max_header_bytes,
        max_future_skew=settings.max_future_skew,
        allow_extra_fields=settings.allow_extra_fields,
    )


def memory_budget(settings: Settings, shards: int = 1) -> MemoryBudget:
    """What the process may hold at ``settings``; ``shards``: a sharded queue's, each shard a
    consume channel with a prefetch window of its own."""
    return MemoryBudget(
        prefetch=settings.prefetch * shards,
        max_body_bytes=settings.max_body_bytes,
        workers=max_workers(settings),
        limit=settings.memory_limit,
        max_header_bytes=settings.max_header_bytes,
    )


def receipt_window(settings: Settings, retention: timedelta | None = None) -> ReceiptWindow:
    """The receipts' window at ``settings``; ``retention``: a queue table's longest instead of
    the setting (what the pruner keeps: :attr:`QueueTable.receipt_retention`)."""
    return ReceiptWindow(
        retention=retention if retention is not None else settings.receipt_retention,
        margin=settings.receipt_margin,
        partition=settings.receipt_partition,
        prune_interval=settings.receipt_prune_interval,
    )
