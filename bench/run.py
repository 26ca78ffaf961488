"""``python -m bench run``: every system, ``--runs`` times, interleaved, then the latency runs."""

from __future__ import annotations

import os
import shutil
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from importlib import metadata
from pathlib import Path
from typing import Any

import aio_pika
import asyncpg

from bench import handler_rows, measure, report
from bench.events import Workload
from bench.infra import BenchError, Infra
from bench.measure import Measurement
from consumer.config.settings import Settings
from consumer.service.components import batch_size, worker_count
from topology.durations import format_duration

SYSTEMS = ("broker", "database", "service", "celery", "dramatiq")


def _service_default(field: str) -> str:
    # Read from the service's own Settings so the report cannot drift from what actually ran.
    default = Settings.model_fields[field].default
    return format_duration(default) if isinstance(default, timedelta) else str(default)


SERVICE_KNOBS = {
    f"CONSUMER_{field.upper()}": _service_default(field)
    for field in (
        "prefetch",
        "db_pool_size",
        "workers",
        "batch_size",
        "batch_wait",
        "batch_lock_timeout",
    )
}


@dataclass(frozen=True)
class Sizes:
    """The service's sizes in force, which the reference rows copy."""

    prefetch: int
    pool: int
    batch: int


@dataclass(frozen=True)
class BenchOptions:
    events: int
    runs: int
    skus: int
    seed: int
    systems: tuple[str, ...]
    service_env: dict[str, str]
    latency: bool
    latency_seconds: float
    latency_warmup: float
    latency_rates: tuple[float, ...]
    prefetch: bool
    prefetches: tuple[int, ...]
    amqp_url: str
    admin_dsn: str
    results_dir: Path
    keep_logs: bool
    handlers: bool = False
    handler_modes: tuple[str, ...] = ()
    handler_events: dict[str, int] = field(default_factory=dict)


def progress(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def effective_knobs(service_env: Mapping[str, str]) -> dict[str, str]:
    """The service settings in force: --service-env, else the environment, else the default
    (the batch size's follows from the prefetch and the pool, as the service derives it)."""
    knobs = {
        key: service_env.get(key) or os.environ.get(key) or default
        for key, default in SERVICE_KNOBS.items()
    }
    sizes = Settings.model_construct(
        prefetch=positive_int(knobs, "CONSUMER_PREFETCH"),
        db_pool_size=positive_int(knobs, "CONSUMER_DB_POOL_SIZE"),
        workers=None
        if knobs["CONSUMER_WORKERS"] == "None"
        else positive_int(knobs, "CONSUMER_WORKERS"),
        batch_size=None,
    )
    if knobs["CONSUMER_WORKERS"] == "None":
        knobs["CONSUMER_WORKERS"] = str(worker_count(sizes))
    if knobs["CONSUMER_BATCH_SIZE"] == "None":
        sizes = sizes.model_copy(update={"workers": positive_int(knobs, "CONSUMER_WORKERS")})
        knobs["CONSUMER_BATCH_SIZE"] = str(batch_size(sizes))
    return knobs


def positive_int(knobs: Mapping[str, str], key: str) -> int:
    try:
        value = int(knobs[key])
    except ValueError:
        raise BenchError(f"{key}={knobs[key]!r} is not a whole number") from None
    if value < 1:
        raise BenchError(f"{key} must be at least 1")
    return value


def versions() -> dict[str, str]:
    found = {}
    for package in ("rabbit-pg-consumer", "aio-pika", "asyncpg", "celery", "dramatiq", "psycopg"):
        try:
            found[package] = metadata.version(package)
        except metadata.PackageNotFoundError:
            found[package] = "not installed"
    return found


async def server_versions(amqp_url: str, admin_dsn: str) -> dict[str, str]:
    connection = await aio_pika.connect(amqp_url)
    try:
        transport = connection.transport
        properties: Any = transport.connection.server_properties if transport else {}
        rabbit = properties.get("version", "?")
        rabbit = rabbit.decode() if isinstance(rabbit, bytes) else str(rabbit)
    finally:
        await connection.close()
    conn = await asyncpg.connect(admin_dsn)
    try:
        postgres = str(await conn.fetchval("SHOW server_version"))
    finally:
        await conn.close()
    return {"rabbitmq": rabbit, "postgresql": postgres.split()[0]}


def machine() -> str:
    load = " ".join(f"{value:.2f}" for value in os.getloadavg())
    return f"{os.cpu_count()} cores, load average {load} at start"


def describe(measurement: Measurement) -> str:
    if measurement.error:
        return f"FAILED: {measurement.error.splitlines()[0][:300]}"
    parts = [f"{measurement.rate:,.0f}/s" if measurement.rate else "no rate"]
    if measurement.wall_s is not None:
        parts.append(f"wall {measurement.wall_s:.1f}s")
    if measurement.peak_rss_mb:
        parts.append(f"peak RSS {measurement.peak_rss_mb:.0f} MB")
    if measurement.cpu:
        parts.append("cpu " + " ".join(f"{k}={v:.0f}%" for k, v in measurement.cpu.items()))
    extra = measurement.extra
    if "p50_ms" in extra:
        parts.append(
            f"p50 {extra['p50_ms']} ms p99 {extra['p99_ms']} ms max {extra.get('max_ms')} ms, "
            f"published {extra.get('published_rate')}/s, backlog {extra.get('backlog_at_end')}"
        )
    if "histogram_p99_ms" in extra:
        parts.append(f"(histogram {extra['histogram_p50_ms']}/{extra['histogram_p99_ms']} ms)")
    return ", ".join(parts)


async def _guarded(
    system: str, run: int, events: int, action: Callable[[], Awaitable[Measurement]]
) -> Measurement:
    started = time.monotonic()
    try:
        result = await action()
    except BenchError as error:
        result = Measurement(system, run, events, error=str(error))
    progress(f"  {system:<12} run {run}: {describe(result)} [{time.monotonic() - started:.0f}s]")
    return result


async def run_bench(options: BenchOptions) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    knobs = effective_knobs(options.service_env)
    sizes = Sizes(
        prefetch=positive_int(knobs, "CONSUMER_PREFETCH"),
        pool=positive_int(knobs, "CONSUMER_DB_POOL_SIZE"),
        batch=positive_int(knobs, "CONSUMER_BATCH_SIZE"),
    )
    infra = Infra.start(options.amqp_url, options.admin_dsn, options.results_dir, stamp)
    workload = Workload(options.events, options.skus, options.seed)
    started_text = machine()
    result: dict[str, Any] = {
        "kind": "bench",
        "started": stamp,
        "events": options.events,
        "runs": options.runs,
        "skus": options.skus,
        "settings": {
            "service": {
                **knobs,
                # Unset, the worker count and batch size follow the handlers as the service runs
                # (consumer.service.concurrency_policy).
                **{
                    key: "adaptive"
                    for key in ("CONSUMER_WORKERS", "CONSUMER_BATCH_SIZE")
                    if not (options.service_env.get(key) or os.environ.get(key))
                },
                **options.service_env,
            },
            "broker_prefetch": sizes.prefetch,
            "pgbench": {"clients": sizes.pool, "events_per_transaction": sizes.batch},
            "celery": {"pool": "prefork", "concurrency": 2, "prefetch_total": sizes.prefetch},
            "dramatiq": {"processes": 2, "threads": 4, "prefetch_total": sizes.prefetch},
            "latency": {
                "rates": list(options.latency_rates) if options.latency else [],
                "seconds": options.latency_seconds,
                "warmup_seconds": options.latency_warmup,
            },
            "prefetches": list(options.prefetches) if options.prefetch else [],
        },
        "versions": {**versions(), **await server_versions(options.amqp_url, options.admin_dsn)},
        "machine": started_text,
    }
    progress(
        f"bench {infra.prefix}: {options.events:,} events x {options.runs} runs; {started_text}"
    )
    measurements: dict[str, list[Measurement]] = {system: [] for system in options.systems}
    try:
        for run in range(1, options.runs + 1):
            progress(f"run {run}/{options.runs}")
            for system in options.systems:
                action = _action(system, infra, workload, run, options, sizes)
                measurements[system].append(await _guarded(system, run, options.events, action))
        if options.latency:
            result["latency"] = await _latency_rows(infra, workload, options, sizes)
        if options.prefetch:
            result["prefetch"] = await _prefetch_rows(infra, workload, options)
        if options.handlers and "service" in options.systems:
            progress("per-event handlers")
            result["handlers"] = await handler_rows.handler_rows(
                infra,
                workload,
                runs=options.runs,
                modes=options.handler_modes,
                events=options.handler_events,
                service_env=options.service_env,
                guarded=_guarded,
            )
    finally:
        await _cleanup(infra)
    result["systems"] = {
        system: report.summarize_system(runs) for system, runs in measurements.items()
    }
    result["ratios"] = report.ratios(result["systems"])
    failed = (
        any(m.error for runs in measurements.values() for m in runs)
        or any(
            summary["errors"]
            for row in result.get("latency", ())
            for summary in row["systems"].values()
        )
        or any(
            row[side]["errors"]
            for row in result.get("prefetch", ())
            for side in SIDES
            if side in row
        )
        or any(row["errors"] for row in result.get("handlers", ()))
    )
    if options.keep_logs or failed:
        result["logs"] = str(infra.log_dir)
    else:
        shutil.rmtree(infra.log_dir, ignore_errors=True)
    return result


def _action(
    system: str,
    infra: Infra,
    workload: Workload,
    run: int,
    options: BenchOptions,
    sizes: Sizes,
) -> Callable[[], Awaitable[Measurement]]:
    async def action() -> Measurement:
        if system == "broker":
            return await measure.broker_limit(
                infra, workload, run, prefetch=sizes.prefetch, service_env=options.service_env
            )
        if system == "database":
            return await measure.database_limit(
                infra, workload, run, clients=sizes.pool, batch=sizes.batch
            )
        if system == "service":
            return await measure.service_throughput(
                infra, workload, run, service_env=options.service_env
            )
        if system == "celery":
            return await measure.celery_throughput(infra, workload, run, prefetch=sizes.prefetch)
        if system == "dramatiq":
            return await measure.dramatiq_throughput(infra, workload, run, prefetch=sizes.prefetch)
        raise BenchError(f"unknown system {system!r}")

    return action


SIDES = ("broker", "samejob", "service")


async def _latency_rows(
    infra: Infra, workload: Workload, options: BenchOptions, sizes: Sizes
) -> list[dict[str, Any]]:
    """The latency table: at each rate, the service and the peers among ``--systems``, each
    started on an empty queue and fed by the same paced publisher, interleaved run by run."""
    systems = [system for system in measure.LATENCY_SYSTEMS if system in options.systems]
    runs: dict[float, dict[str, list[Measurement]]] = {
        rate: {system: [] for system in systems} for rate in options.latency_rates
    }
    for run in range(1, options.runs + 1):
        progress(f"latency run {run}/{options.runs}")
        for rate in options.latency_rates:
            for system in systems:

                async def action(
                    run: int = run, rate: float = rate, system: str = system
                ) -> Measurement:
                    return await measure.latency(
                        infra,
                        workload,
                        run,
                        system=system,
                        rate=rate,
                        seconds=options.latency_seconds,
                        warmup=options.latency_warmup,
                        service_env=options.service_env,
                        prefetch=sizes.prefetch,
                    )

                runs[rate][system].append(await _guarded(f"{system}@{rate:g}/s", run, 0, action))
    return [report.summarize_latency_rate(rate, runs[rate]) for rate in options.latency_rates]


async def _prefetch_rows(
    infra: Infra, workload: Workload, options: BenchOptions
) -> list[dict[str, Any]]:
    """The prefetch table: at each prefetch, the ack-only consumer and the service (given
    ``CONSUMER_PREFETCH`` and nothing else: its batch size and workers follow from it) drain the
    same workload from the same kind of queue, interleaved run by run."""
    runs: dict[int, dict[str, list[Measurement]]] = {
        prefetch: {side: [] for side in SIDES} for prefetch in options.prefetches
    }
    for run in range(1, options.runs + 1):
        progress(f"prefetch run {run}/{options.runs}")
        for prefetch in options.prefetches:
            env = {**options.service_env, "CONSUMER_PREFETCH": str(prefetch)}

            async def broker(
                run: int = run, prefetch: int = prefetch, env: dict[str, str] = env
            ) -> Measurement:
                return await measure.broker_limit(
                    infra,
                    workload,
                    run,
                    prefetch=prefetch,
                    service_env=env,
                    label=f"pf{prefetch}ack",
                )

            async def service(
                run: int = run, prefetch: int = prefetch, env: dict[str, str] = env
            ) -> Measurement:
                return await measure.service_throughput(
                    infra, workload, run, service_env=env, label=f"pf{prefetch}svc"
                )

            async def samejob(
                run: int = run, prefetch: int = prefetch, env: dict[str, str] = env
            ) -> Measurement:
                return await measure.same_job_limit(
                    infra,
                    workload,
                    run,
                    prefetch=prefetch,
                    service_env=env,
                    label=f"pf{prefetch}job",
                )

            for side, action in (("broker", broker), ("samejob", samejob), ("service", service)):
                runs[prefetch][side].append(
                    await _guarded(f"{side}@{prefetch}", run, options.events, action)
                )
    rows = []
    for prefetch in options.prefetches:
        knobs = effective_knobs({**options.service_env, "CONSUMER_PREFETCH": str(prefetch)})
        batch = positive_int(knobs, "CONSUMER_BATCH_SIZE")
        workers = positive_int(knobs, "CONSUMER_WORKERS")
        rows.append(
            report.summarize_prefetch(
                prefetch,
                batch,
                runs[prefetch]["broker"],
                runs[prefetch]["service"],
                workers,
                samejob=runs[prefetch]["samejob"],
            )
        )
    return rows


async def _cleanup(infra: Infra) -> None:
    """Leave nothing behind: this invocation's queues, exchanges and databases."""
    for what, step in (
        ("broker objects", infra.sweep_broker),
        ("celery delayed-delivery topology", infra.remove_celery_delayed_delivery),
        ("databases", infra.drop_all_databases),
    ):
        try:
            await step()
        except (BenchError, OSError, asyncpg.PostgresError, aio_pika.exceptions.AMQPError) as e:
            progress(f"cleanup of {what} failed: {e}")
