"""``consumer run``: the one place that builds the service from its settings and runs it.

Every component gets its own part of the configuration (:mod:`consumer.service.components`) here;
nothing else constructs them. :func:`serve` adds what only a running process has: signals, the
watchdog, the HTTP endpoint.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from uuid import UUID, uuid4

from prometheus_client import CollectorRegistry

from consumer.allocator import keep_frame_buffers_on_heap
from consumer.amqp import fast_paths
from consumer.amqp.session import Consumed
from consumer.config.queue_table import QueueSpec, QueueTable
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, EXIT_FAILURE
from consumer.db.crashes import CrashLedger, Liveness
from consumer.db.migration_sets import discover, migration_sets
from consumer.db.pruning import ReceiptPruner
from consumer.errors import (
    BrokerUnreachable,
    ConfigError,
    MigrationError,
    PipelineFault,
    TopologyMissing,
)
from consumer.event_loop import run_event_loop
from consumer.logs import (
    Logger,
    MessageLog,
    StructlogMessageLog,
    TickFlushed,
    make_logger,
    make_message_log,
    route_library_logs,
)
from consumer.observe.http import HttpServer, ReadinessCheck, build_app
from consumer.observe.metrics import Metrics, ServiceRegistry
from consumer.observe.queue_metrics import QueueMetricsRegistry
from consumer.observe.readiness import QueuesReadiness
from consumer.observe.report import OutcomeReporter
from consumer.observe.tracing_setup import TracingSetup
from consumer.pipeline.calls import HandlerCalls, RunningCall
from consumer.pipeline.tracing import Tracing
from consumer.registry import HandlerRegistry
from consumer.service.assembly import build_pipeline
from consumer.service.components import (
    batch_size,
    batch_wait,
    broker_config,
    concurrency_limits,
    database_config,
    max_workers,
    memory_budget,
    names_for,
    receipt_window,
    relay_config,
    topology_spec,
)
from consumer.service.concurrency import Concurrency
from consumer.service.dispatch import Dispatcher
from consumer.service.isolated import IsolationGate
from consumer.service.memory import worst_case, worst_case_of_queues
from consumer.service.outbox_relay import OutboxRelay
from consumer.service.pruner import PeriodicPruner
from consumer.service.supervisor import Service, ServiceConfig
from consumer.service.watchdog import LoopWatchdog
from consumer.service.window import PrefetchWindow
from consumer.service.workers import Workers
from topology.names import rung_label, shard_label
from topology.plan import build_topology

__all__ = ["build_service", "run", "serve", "serve_table"]

EXIT_SECOND_SIGNAL = 130


def run(settings: Settings, registry: HandlerRegistry, table: QueueTable | None = None) -> int:
    """The service in this process until it stops: its logs, its metrics, its event loop; with a
    queue ``table`` (``CONSUMER_QUEUES_FILE``), each of its queues (:func:`serve_table`)."""
    tuned_allocator = keep_frame_buffers_on_heap()
    lines = TickFlushed(sys.stdout.buffer)
    logger = make_logger(
        settings.name, level=settings.log_level, log_format=settings.log_format, lines=lines
    )
    message_log = make_message_log(
        logger, settings.name, level=settings.log_level, log_format=settings.log_format, lines=lines
    )
    route_library_logs(logger)
    if table is not None and table.path is not None:
        return run_event_loop(
            serve_table(
                settings,
                registry,
                table,
                logger,
                before_exit=lines.write_out,
                message_log=message_log,
                tuned_allocator=tuned_allocator,
            )
        )
    rungs = [rung_label(delay) for delay in settings.retry_delays]
    metrics = Metrics(ServiceRegistry(), registry, rungs, name=settings.name)
    return run_event_loop(
        serve(
            settings,
            registry,
            logger,
            metrics,
            before_exit=lines.write_out,
            message_log=message_log,
            tuned_allocator=tuned_allocator,
        )
    )


def build_service(
    settings: Settings,
    registry: HandlerRegistry,
    logger: Logger,
    metrics: Metrics,
    *,
    calls: HandlerCalls,
    owner: UUID,
    tracing: Tracing | None = None,
    message_log: MessageLog | None = None,
    queue: QueueSpec | None = None,
    prune: bool = True,
    receipts_kept: timedelta | None = None,
    isolation: IsolationGate | None = None,
) -> Service:
    """The service, wired: a delivery passes the dispatcher, a worker, the pipeline (prepare,
    batch engine, handler call) and the settler, in that order; ``tracing`` follows it through
    (off by default). ``message_log`` takes the line per settled delivery (through ``logger``
    unless given).

    With ``queue`` (a row of the queue table, ``settings`` its own), the service of that queue:
    its work queue, ladder and dead letters, its channel, prefetch, workers and pool; ``prune``
    false leaves the receipts' partitions to another queue's service (one table, one pruner);
    ``receipts_kept``: how long the pruner keeps them, the table's longest retention (each
    queue's own expiry check is its own ``receipt_retention``); ``isolation``: the gate the
    queues of the process share, so that a delivery applied isolated has nothing of any queue
    in flight beside it (crash attribution, :mod:`consumer.db.crashes`)."""
    name = queue.name if queue is not None else None
    names = names_for(settings, name)
    spec = (
        topology_spec(settings, registry)
        if queue is None
        else topology_spec(settings, queue.types, name, queue.shards)
    )
    topology = build_topology(spec)
    # A sharded queue: each shard on a channel of its own, with the queue's prefetch each, all
    # feeding this queue's workers.
    consumed = (
        [Consumed(names.shard(shard), shard_label(shard)) for shard in queue.consumed_shards]
        if queue is not None and queue.shards > 1
        else [Consumed(names.work)]
    )
    parts = build_pipeline(
        settings,
        registry,
        calls=calls,
        owner=owner,
        tracing=tracing,
        on_conflict=metrics.batch_conflicts.inc,
        queue=name,
    )
    database, preparer, pipeline, settler = (
        parts.database,
        parts.preparer,
        parts.pipeline,
        parts.settler,
    )
    window = PrefetchWindow(settings.prefetch * len(consumed))
    dispatcher = Dispatcher(
        workers=max_workers(settings),
        batch_size=batch_size(settings),
        batch_wait=batch_wait(settings),
        preparer=preparer,
        settler=settler,
        window_full=window.full,
        isolation=isolation,
    )
    concurrency = Concurrency(
        limits=concurrency_limits(
            settings,
            # A queue of the table starts as its own handlers would, not another queue's; a
            # registry with any batch handler starts as batch handlers do (the start of
            # concurrency_policy.initial for per-event handlers only: small batches of a batch
            # handler go through its per-event form and would keep the start in place).
            per_event_handlers=all(
                registry[event_type].many is None
                for event_type in (queue.types if queue is not None else registry)
                if event_type in registry
            ),
        ),
        handler_time=parts.handler_time,
        dispatcher=dispatcher,
        metrics=metrics,
        logger=logger,
    )

    def on_pause(error: BaseException) -> None:
        logger.warning("database unreachable, pausing consumption", error=str(error))
        metrics.paused.set(1)

    workers = Workers(
        dispatcher=dispatcher,
        pipeline=pipeline,
        settler=settler,
        reporter=OutcomeReporter(
            message_log or StructlogMessageLog(logger),
            metrics,
            log_payloads=settings.log_payloads,
            tracing=tracing,
        ),
        on_pause=on_pause,
        tracing=tracing,
        queue=names.work,
        on_batch=lambda events, seconds, cpu: concurrency.batch_done(
            events=events, seconds=seconds, cpu=cpu
        ),
    )
    relay = (
        OutboxRelay(
            relay_config(settings, registry),
            connect=database.connect_one,
            publisher=lambda: settler.publisher,
            logger=logger,
            metrics=metrics,
        )
        # One relay per process: with a queue table, beside the pruner (the first queue's).
        if settings.outbox_relay and prune
        else None
    )
    return Service(
        config=ServiceConfig(
            # A queue's connection is named after it (svc.sms/consumer@host:pid) in the broker's
            # list of connections.
            broker=replace(broker_config(settings), service=names.prefix),
            reconnect_max_delay=settings.reconnect_max_delay.total_seconds(),
            shutdown_grace=settings.shutdown_grace.total_seconds(),
            migrations=tuple(
                migration
                for migration_set in migration_sets(settings.handlers)
                for migration in discover(migration_set)
            ),
            max_clock_skew=settings.max_clock_skew,
        ),
        names=names,
        topology=topology,
        database=database,
        dispatcher=dispatcher,
        workers=workers,
        settler=settler,
        window=window,
        liveness=Liveness(parts.ledger, database.connect_one),
        logger=logger,
        metrics=metrics,
        pruner=PeriodicPruner(
            ReceiptPruner(
                receipt_window(settings, receipts_kept),
                max_future_skew=settings.max_future_skew,
                lock_wait=settings.receipt_prune_lock_wait,
            ),
            connect=database.connect_one,
            max_clock_skew=settings.max_clock_skew,
            logger=logger,
            metrics=metrics,
        )
        if prune
        else None,
        relay=relay,
        consumed=consumed,
    )


@dataclass(frozen=True, slots=True)
class _Built:
    """What :func:`_serve` runs: the services (one per queue), what ``/metrics`` exports and
    what ``/readyz`` asks."""

    services: Sequence[Service]
    metrics: CollectorRegistry
    readiness: ReadinessCheck


async def serve(
    settings: Settings,
    registry: HandlerRegistry,
    logger: Logger,
    metrics: Metrics,
    *,
    before_exit: Callable[[], None] = lambda: None,
    message_log: MessageLog | None = None,
    tuned_allocator: bool = False,
) -> int:
    """Run the service until SIGTERM or SIGINT; a second signal exits at once. The exit code.

    ``before_exit`` writes out the log lines still held for the end of the loop's turn: the
    immediate exits (second signal, hard time limit) skip the interpreter's clean-up.
    ``tuned_allocator`` (logged) says whether :mod:`consumer.allocator` set glibc's thresholds.
    """
    owner = uuid4()

    def build(calls: HandlerCalls, tracer: Tracing) -> _Built:
        service = build_service(
            settings,
            registry,
            logger,
            metrics,
            calls=calls,
            owner=owner,
            tracing=tracer,
            message_log=message_log,
        )
        return _Built((service,), metrics.registry, service.readiness)

    return await _serve(
        settings,
        logger,
        build,
        convict=_convicting(settings, owner),
        hard_limit=settings.hard_timeout.total_seconds(),
        before_exit=before_exit,
        handlers=list(registry),
        # The worst case start-up checked against the memory limit: what the process at these
        # settings can hold, whatever its producers send (consumer.service.memory).
        memory_budget_bytes=worst_case(memory_budget(settings)),
        tuned_allocator=tuned_allocator,
    )


async def serve_table(
    settings: Settings,
    registry: HandlerRegistry,
    table: QueueTable,
    logger: Logger,
    *,
    before_exit: Callable[[], None] = lambda: None,
    message_log: MessageLog | None = None,
    tuned_allocator: bool = False,
) -> int:
    """:func:`serve` for a queue table: in one process, one service per queue, each with its
    own channel, prefetch, workers, pool and metrics (labelled ``queue``), so that one queue's
    slow or failing work holds none of the others' workers. One ``/readyz`` lists every queue;
    one pruner keeps the receipts (one table for every queue). A queue that stops the process
    (a bug, its topology missing) stops the others gracefully first."""
    owners = {queue.label: uuid4() for queue in table.queues}
    # One gate for every queue: a delivery applied isolated has nothing of any queue beside it.
    isolation = IsolationGate()

    def build(calls: HandlerCalls, tracer: Tracing) -> _Built:
        services: dict[str, Service] = {}
        registries: dict[str, CollectorRegistry] = {}
        for index, queue in enumerate(table.queues):
            own = queue.settings
            rungs = [rung_label(delay) for delay in own.retry_delays]
            metrics = Metrics(ServiceRegistry(), queue.types, rungs, name=settings.name)
            services[queue.label] = build_service(
                own,
                registry,
                logger.bind(queue=queue.label),
                metrics,
                calls=calls,
                owner=owners[queue.label],
                tracing=tracer,
                message_log=message_log,
                queue=queue,
                prune=index == 0,
                receipts_kept=table.receipt_retention,
                isolation=isolation,
            )
            registries[queue.label] = metrics.registry

        async def readiness() -> QueuesReadiness:
            return QueuesReadiness(
                {label: await service.readiness() for label, service in services.items()}
            )

        return _Built(tuple(services.values()), QueueMetricsRegistry(registries), readiness)

    # The event loop is one: blocked, it blocks every queue. Its limit is the longest queue's.
    longest = max(table.queues, key=lambda queue: queue.settings.hard_timeout)
    return await _serve(
        settings,
        logger,
        build,
        convict=_convicting(longest.settings, owners[longest.label], table),
        hard_limit=longest.settings.hard_timeout.total_seconds(),
        before_exit=before_exit,
        handlers=list(registry),
        queues={queue.label: list(queue.types) for queue in table.queues},
        memory_budget_bytes=worst_case_of_queues(
            memory_budget(queue.settings, len(queue.consumed_shards)) for queue in table.queues
        ),
        tuned_allocator=tuned_allocator,
    )


async def _serve(
    settings: Settings,
    logger: Logger,
    build: Callable[[HandlerCalls, Tracing], _Built],
    *,
    convict: Callable[[RunningCall, float], bool],
    hard_limit: float,
    before_exit: Callable[[], None],
    **starting: object,
) -> int:
    """What :func:`serve` and :func:`serve_table` share: signals, tracing, the watchdog, the
    HTTP endpoint, and the services ``build`` makes, run until ``stop``."""
    stop = asyncio.Event()
    _on_signals(stop, logger, before_exit)
    calls = HandlerCalls()
    try:
        tracing = TracingSetup.from_environment(settings.name)
    except ConfigError as error:
        return _fatal(logger, str(error), EXIT_CONFIG)
    # Spans still buffered go out after the service has stopped (a thread waits for them).
    async with tracing as tracer:
        if tracing.missing_extra:
            logger.warning(
                "tracing is configured (OTEL_*) but the otel extra is not installed: tracing is "
                "off (pip install 'rabbit-pg-consumer[otel]')"
            )
        try:
            built = build(calls, tracer)
        except ConfigError as error:
            return _fatal(logger, str(error), EXIT_CONFIG)
        except MigrationError as error:
            return _fatal(logger, str(error), EXIT_FAILURE)
        logger.info("starting", settings=settings.describe(), **starting)
        _warn_of_refused_hooks(logger, fast_path=settings.amqp_fast_path)
        try:
            async with (
                LoopWatchdog(
                    limit=hard_limit,
                    logger=logger,
                    calls=calls,
                    convict=convict,
                    before_exit=before_exit,
                ),
                HttpServer(
                    build_app(built.metrics, built.readiness),
                    host=settings.http_host,
                    port=settings.http_port,
                ),
            ):
                logger.info("serving HTTP", host=settings.http_host, port=settings.http_port)
                await _run_all(built.services, stop)
        except OSError as error:
            return _fatal(
                logger,
                f"CONSUMER_HTTP_HOST/CONSUMER_HTTP_PORT: cannot listen on "
                f"{settings.http_host}:{settings.http_port}: {error.strerror or error}",
                EXIT_CONFIG,
            )
        except ConfigError as error:
            return _fatal(logger, str(error), EXIT_CONFIG)
        except (TopologyMissing, PipelineFault, BrokerUnreachable) as error:
            return _fatal(logger, str(error), EXIT_FAILURE)
    logger.info("stopped")
    return 0


async def _run_all(services: Sequence[Service], stop: asyncio.Event) -> None:
    """Each service until ``stop``; one that ends (it raised) stops the others, which drain
    gracefully, and its error is raised once all have."""
    if len(services) == 1:
        await services[0].run(stop)
        return

    async def one(service: Service) -> None:
        try:
            await service.run(stop)
        finally:
            stop.set()

    results = await asyncio.gather(*(one(service) for service in services), return_exceptions=True)
    for result in results:
        if isinstance(result, BaseException):
            raise result


def _warn_of_refused_hooks(logger: Logger, *, fast_path: bool) -> None:
    """One line if aiormq's or pamqp's private code is not what a hook replaces: that part runs
    on the library's own code (:mod:`consumer.amqp.fast_paths`)."""
    refused = fast_paths.refused(fast_path=fast_path)
    if refused:
        logger.warning(
            "aiormq's or pamqp's private code differs from what the service replaces: those "
            "parts run on the library's own code",
            hooks=sorted(refused),
            differences=[
                f"{hook}: {problem}" for hook, found in refused.items() for problem in found
            ],
        )


def _on_signals(stop: asyncio.Event, logger: Logger, before_exit: Callable[[], None]) -> None:
    """The first SIGTERM or SIGINT stops gracefully; a second exits at once."""
    seen = 0

    def on_signal(received: signal.Signals) -> None:
        nonlocal seen
        seen += 1
        if seen == 1:
            logger.info("stopping: finishing in-flight messages", signal=received.name)
            stop.set()
            return
        logger.warning("second signal: exiting now", signal=received.name)
        before_exit()
        sys.stdout.flush()
        os._exit(EXIT_SECOND_SIGNAL)

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig)


def _convicting(
    settings: Settings, owner: UUID, table: QueueTable | None = None
) -> Callable[[RunningCall, float], bool]:
    """What the watchdog calls, from its own thread, to record the event that blocked the loop;
    with a queue ``table``, the verdict names the queue of the event's type."""
    limit = settings.hard_timeout.total_seconds()

    def convict(call: RunningCall, blocked: float) -> bool:
        queue = _queue_of(table, call.describe().get("type"))
        ledger = CrashLedger(consumer=settings.name, owner=owner, queue=queue)
        where = f" (queue {queue})" if queue is not None else ""
        detail = (
            f"{call.handler} blocked the event loop for {blocked:.1f}s, past the hard time limit "
            f"of {limit:g}s (CONSUMER_HARD_TIMEOUT){where}; the process exited"
        )
        database = database_config(settings)
        return ledger.convict_blocking(
            database.connector(), database.dsn, call.event_ids[0], detail
        )

    return convict


def _queue_of(table: QueueTable | None, event_type: object) -> str | None:
    if table is None or not isinstance(event_type, str):
        return None
    try:
        return table.queue_of(event_type).name
    except KeyError:
        return None


def _fatal(logger: Logger, message: str, code: int) -> int:
    logger.error("cannot run", error=message)
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code
