"""One measurement of each kind: the broker limit, the database limit, a consumer process draining
a pre-filled queue (the service, Celery, Dramatiq), and the service's publish-to-commit latency.

Throughput of a consumer process is measured in steady state, from the first effect seen committed
to the last, by polling ``count(*)`` of ``stock_movements`` every 50 ms: start-up (imports,
connecting, declaring) is left out of the rate, and reported separately as ``wall_s`` (spawn to
the last commit).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import resource
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import aiormq
import asyncpg
from prometheus_client.parser import text_string_to_metric_families

from bench import procfs, wire
from bench.events import EVENT_TYPE, Workload, encode
from bench.infra import REPO, BenchError, Child, Infra, find_pgbench, free_port
from bench.paced import paced_publish
from bench.wire import Wire

POLL_INTERVAL = 0.05
STALL_TIMEOUT = 90.0


@dataclass
class Measurement:
    """One run of one system."""

    system: str
    run: int
    events: int
    rate: float | None = None  # messages (or transactions) per second, steady state
    wall_s: float | None = None
    peak_rss_mb: float | None = None
    cpu: dict[str, float] = field(default_factory=dict)
    extra: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


def cpu_groups(root: int | None, database: str | None) -> dict[str, procfs.ProcessGroup]:
    groups: dict[str, procfs.ProcessGroup] = {}
    if root is not None:
        groups["sut"] = root
    if database is not None:
        # Backends of this run's database only (their process title names it), not others'.
        groups["postgres"] = procfs.Named("postgres", cmdline_contains=f" {database} ")
    groups["rabbitmq"] = procfs.Named("beam.smp")
    return groups


# -- the broker limit ---------------------------------------------------------------------------


async def broker_limit(
    infra: Infra,
    workload: Workload,
    run: int,
    *,
    prefetch: int,
    service_env: Mapping[str, str],
    label: str = "ack",
) -> Measurement:
    """An ack-only aio-pika consumer on a work queue declared by the service's own topology."""
    result = Measurement("broker", run, workload.events)
    name = infra.name(f"{label}{run}")
    env = infra.child_env({**service_env, **owned_env(infra, name, "postgresql://unused/x")})
    try:
        await infra.run_module("topology", "apply", env=env)
        await _ack_only(infra, workload, name, prefetch, result)
    finally:
        await infra.sweep_broker(name)
    return result


async def same_job_limit(
    infra: Infra,
    workload: Workload,
    run: int,
    *,
    prefetch: int,
    service_env: Mapping[str, str],
    label: str = "job",
) -> Measurement:
    """The minimal consumer that does the service's job (:mod:`bench.samejob`), on a work queue
    declared by the service's own topology and a database of its own; exactly once checked."""
    result = Measurement("samejob", run, workload.events)
    name = infra.name(f"{label}{run}")
    dsn = await infra.create_database(name, workload)
    env = infra.child_env({**service_env, **owned_env(infra, name, dsn)})
    try:
        await infra.run_module("topology", "apply", env=env)
        await _ack_only(
            infra, workload, name, prefetch, result, module="bench.samejob", extra=(dsn, name)
        )
        result.extra = await check_effects(dsn, name, workload.events)
    finally:
        await infra.drop_database(name)
        await infra.sweep_broker(name)
    return result


async def _ack_only(
    infra: Infra,
    workload: Workload,
    name: str,
    prefetch: int,
    result: Measurement,
    *,
    module: str = "bench.ackonly",
    extra: tuple[str, ...] = (),
) -> None:
    """Run ``module`` (the ack-only consumer, or the same-job one) on the queue ``workload`` filled
    and put its rate, wall time, CPU and peak RSS (its own report) into ``result``."""
    queue, exchange = f"{name}.work", f"{name}.events"
    await infra.publish(exchange, EVENT_TYPE, (encode(event) for event in workload.envelopes()))
    await infra.wait_for_depth(queue, workload.events)
    spawned = time.time()
    process = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        module,
        infra.amqp_url,
        queue,
        str(prefetch),
        str(workload.events),
        *extra,
        cwd=REPO,
        env=infra.child_env(),
        stdout=subprocess.PIPE,
    )
    assert process.stdout is not None
    watch = procfs.CpuWatch({"rabbitmq": procfs.Named("beam.smp")})
    final: dict[str, float] = {}
    try:
        while line := await asyncio.wait_for(process.stdout.readline(), STALL_TIMEOUT):
            decoded = json.loads(line)
            if "last" in decoded:
                final = decoded
                result.cpu = watch.stop(time.time())
            else:
                watch.start(time.time())
        await process.wait()
    except TimeoutError:
        process.kill()
        await process.wait()
        raise BenchError(f"{module} stalled") from None
    if process.returncode != 0 or not final:
        raise BenchError(f"{module} exited {process.returncode}")
    # It reports its own CPU time and peak RSS: it may be gone before the harness could look.
    window = max(final["last"] - final["first"], 1e-9)
    result.cpu["sut"] = round(100 * final["cpu_s"] / window, 1)
    result.rate = (final["count"] - 1) / window
    result.wall_s = final["last"] - spawned
    result.peak_rss_mb = round(final["peak_rss_mb"], 1)


def owned_env(infra: Infra, name: str, database_url: str) -> dict[str, str]:
    return {
        "CONSUMER_NAME": name,
        # Our own ingress exchange: publishing to the shared "events" would reach other queues.
        "CONSUMER_EXCHANGE": f"{name}.events",
        "CONSUMER_DATABASE_URL": database_url,
        "CONSUMER_AMQP_URL": infra.amqp_url,
        "CONSUMER_HTTP_HOST": "127.0.0.1",
        "CONSUMER_HTTP_PORT": str(free_port()),
    }


# -- the database limit -------------------------------------------------------------------------

# The service's transaction as a pgbench script: BEGIN, the batch's receipts in one statement,
# then the reserve batch handler's two statements (lock the SKUs' rows, take the stock and write
# the movements), the seal receipts need to commit (sql/004), COMMIT. pgbench cannot build
# arrays, so one more statement draws the batch (fresh ids, SKUs) on the server. Each client draws
# only SKUs of its own residue class, as the service routes equal keys to one worker: without
# that, batches of random SKUs would wait on each other's rows.
PGBENCH_BATCH = """\
\\set first 1 + :client_id
\\set span :skus / :clients
BEGIN;
SELECT array_agg(gen_random_uuid())::text AS batch_ids,
       array_agg(
           'SKU-' || CAST(:first AS integer)
           + CAST(:clients AS integer) * floor(random() * CAST(:span AS integer))::integer
       )::text AS batch_skus
FROM generate_series(1, {batch}) \\gset
INSERT INTO receipts (consumer, event_id, type, occurred_at)
SELECT 'pgbench', id, '{type}', now() FROM unnest(CAST(:batch_ids AS uuid[])) AS id
WHERE NOT EXISTS (
    SELECT FROM receipts_legacy AS legacy WHERE legacy.consumer = 'pgbench' AND legacy.event_id = id
)
ORDER BY id
ON CONFLICT DO NOTHING RETURNING event_id;
SELECT sku, available FROM stock WHERE sku = ANY(CAST(:batch_skus AS text[]))
ORDER BY sku FOR UPDATE;
WITH taken AS (
    UPDATE stock SET available = stock.available - taken.qty
    FROM (
        SELECT sku, count(*) AS qty FROM unnest(CAST(:batch_skus AS text[])) AS sku GROUP BY sku
    ) AS taken
    WHERE stock.sku = taken.sku
)
INSERT INTO stock_movements (event_id, order_id, sku, delta)
SELECT event_id, 'pgbench', sku, -1
FROM unnest(CAST(:batch_ids AS uuid[]), CAST(:batch_skus AS text[])) AS m (event_id, sku);
SELECT set_config('consumer.sealed', 'yes', true);
END;
"""


def pgbench_script(batch: int) -> str:
    return PGBENCH_BATCH.format(type=EVENT_TYPE, batch=batch)


async def database_limit(
    infra: Infra, workload: Workload, run: int, *, clients: int, batch: int
) -> Measurement:
    """pgbench running the service's transaction at its pool size and batch size."""
    if workload.skus < clients:
        raise BenchError(f"--skus {workload.skus} is fewer than the {clients} pgbench clients")
    result = Measurement("database", run, workload.events)
    database = infra.name(f"pg{run}")
    dsn = await infra.create_database(database, workload)
    try:
        script = infra.log_file(f"pgbench-{run}").with_suffix(".sql")
        script.write_text(pgbench_script(batch))
        per_client = math.ceil(workload.events / (clients * batch))
        argv = [
            find_pgbench(),
            "--no-vacuum",
            "--protocol=prepared",
            f"--client={clients}",
            "--jobs=1",
            f"--transactions={per_client}",
            f"--define=skus={workload.skus}",
            f"--define=clients={clients}",
            f"--file={script}",
            dsn,
        ]
        log = infra.log_file(f"pgbench-{run}")
        # pgbench is our child: its CPU comes from getrusage once it has been waited for.
        children_before = _children_cpu()
        child = Child.spawn("pgbench", argv, infra.child_env(), log)
        watch = procfs.CpuWatch(cpu_groups(None, database))
        watch.start(time.time())
        polls = 0
        while child.exited() is None:
            await asyncio.sleep(POLL_INTERVAL)
            polls += 1
            if polls % 2 == 0:
                watch.sample()  # the backends exit with pgbench: see them while they live
            if time.time() - child.started > 600:
                await child.stop()
                raise BenchError("pgbench ran for over 10 minutes")
        finished = time.time()
        result.cpu = watch.stop(finished)
        result.cpu["sut"] = round(
            100 * (_children_cpu() - children_before) / (finished - child.started), 1
        )
        result.wall_s = finished - child.started
        output = child.log_tail(10_000)
        if child.exited() != 0:
            raise BenchError(f"pgbench exited {child.exited()}:\n{output[-2000:]}")
        match = re.search(r"tps = ([0-9.]+) \(without initial connection time\)", output)
        if match is None:
            raise BenchError(f"no tps in pgbench's output:\n{output[-2000:]}")
        result.rate = float(match.group(1)) * batch
        result.extra = {
            "clients": clients,
            "batch": batch,
            "transactions": per_client * clients,
            "committed": await _count(dsn, "SELECT count(*) FROM stock_movements"),
        }
    finally:
        await infra.drop_database(database)
    return result


def _own_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


# -- a consumer process draining a pre-filled queue ---------------------------------------------


async def _count(dsn: str, query: str) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(await conn.fetchval(query))
    finally:
        await conn.close()


async def drain(
    child: Child,
    dsn: str,
    database: str,
    target: int,
    result: Measurement,
    *,
    before_stop: Callable[[], Any] | None = None,
) -> None:
    """Poll the effects until ``target`` are committed; fill in rate, wall time, RSS and CPU."""
    watch = procfs.CpuWatch(cpu_groups(child.pid, database))
    conn = await asyncpg.connect(dsn)
    try:
        first_time = first_count = 0.0
        last_change, last_count = time.time(), -1
        while True:
            count = int(await conn.fetchval("SELECT count(*) FROM stock_movements"))
            now = time.time()
            if count > 0 and not watch.started:
                first_time, first_count = now, count
                watch.start(now)
            if count >= target:
                result.cpu = watch.stop(now)
                result.peak_rss_mb = round(child.peak_rss_mb(), 1)
                result.wall_s = now - child.started
                if now > first_time and count > first_count:
                    result.rate = (count - first_count) / (now - first_time)
                result.extra["window"] = [first_time, now]
                break
            if watch.started and int(now * 4) != int((now - POLL_INTERVAL) * 4):
                watch.sample()
            if count != last_count:
                last_change, last_count = now, count
            elif now - last_change > STALL_TIMEOUT:
                raise BenchError(
                    f"{child.label}: no progress for {STALL_TIMEOUT:.0f}s at {count}/{target}\n"
                    + child.log_tail()
                )
            code = child.exited()
            if code is not None:
                raise BenchError(
                    f"{child.label} exited {code} at {count}/{target}:\n{child.log_tail()}"
                )
            await asyncio.sleep(POLL_INTERVAL)
        if before_stop is not None:
            await before_stop()
    finally:
        await conn.close()


async def check_effects(dsn: str, consumer: str, target: int) -> dict[str, int]:
    """Exactly once: one receipt and one movement per event, and the stock down by as many."""
    conn = await asyncpg.connect(dsn)
    try:
        receipts = int(
            await conn.fetchval("SELECT count(*) FROM receipts WHERE consumer = $1", consumer)
        )
        movements = int(await conn.fetchval("SELECT count(*) FROM stock_movements"))
        delta = int(await conn.fetchval("SELECT coalesce(sum(delta), 0) FROM stock_movements"))
    finally:
        await conn.close()
    if receipts != target or movements != target or delta != -target:
        raise BenchError(
            f"effects wrong: {receipts} receipts, {movements} movements, stock delta {delta} "
            f"for {target} events"
        )
    return {"receipts": receipts, "movements": movements}


async def service_throughput(
    infra: Infra,
    workload: Workload,
    run: int,
    *,
    service_env: Mapping[str, str],
    label: str = "svc",
    template: str | None = None,
    alongside: Callable[[str], contextlib.AbstractAsyncContextManager[Any]] | None = None,
) -> Measurement:
    """Pre-fill the service's work queue, then start ``python -m consumer run`` and time it.
    ``template``: the database is a copy of that one (see :meth:`Infra.create_database`);
    ``alongside``: given the database's DSN, a context that runs while the service drains.
    The worker count and batch size in force at the end (its ``consumer_workers`` and
    ``consumer_batch_size``) go in ``extra``."""
    result = Measurement("service", run, workload.events)
    name = infra.name(f"{label}{run}")
    dsn = await infra.create_database(name, workload, template=template)
    env = infra.child_env({**service_env, **owned_env(infra, name, dsn)})
    try:
        await infra.run_module("topology", "apply", env=env)
        bodies = (encode(event) for event in workload.envelopes())
        await infra.publish(f"{name}.events", EVENT_TYPE, bodies)
        await infra.wait_for_depth(f"{name}.work", workload.events)
        child = Child.spawn(
            "service",
            [sys.executable, "-m", "consumer", "run"],
            env,
            infra.log_file(f"service-{run}"),
        )
        chosen: dict[str, float] = {}

        async def scrape() -> None:
            with contextlib.suppress(aiohttp.ClientError, OSError, TimeoutError):
                chosen.update(await gauges(int(env["CONSUMER_HTTP_PORT"]), CHOICE_GAUGES))

        try:
            async with alongside(dsn) if alongside else contextlib.nullcontext():
                await drain(child, dsn, name, workload.events, result, before_stop=scrape)
        finally:
            code = await child.stop()
        result.extra.update({key.removeprefix("consumer_"): value for key, value in chosen.items()})
        effects = await check_effects(dsn, name, workload.events)
        result.extra = {**result.extra, "exit_code": code, **effects}
    finally:
        await infra.drop_database(name)
        await infra.sweep_broker(name)
    return result


async def _peer_throughput(
    infra: Infra,
    workload: Workload,
    result: Measurement,
    *,
    app: str,
    peer: Peer,
) -> Measurement:
    """Publish the workload through a peer's own client (``<app> publish``), then time its worker
    draining it."""
    env = peer.env
    name = env["BENCH_QUEUE"]
    dsn = env["BENCH_DATABASE_URL"]
    system = result.system
    try:
        await infra.run_module(
            app,
            "publish",
            str(workload.events),
            str(workload.skus),
            str(workload.seed),
            env=env,
            limit_s=600,
        )
        await infra.wait_for_depth(name, workload.events)
        argv = [sys.executable, "-m", *peer.worker_argv]
        child = Child.spawn(system, argv, env, infra.log_file(f"{system}-{result.run}"))
        try:
            await drain(child, dsn, name, workload.events, result)
        finally:
            code = await child.stop()
        result.extra = {
            "exit_code": code,
            **peer.extra,
            **await check_effects(dsn, system, workload.events),
        }
    finally:
        await infra.drop_database(name)
        await infra.sweep_broker(name)
    return result


@dataclass(frozen=True)
class Peer:
    """How to run a peer's worker on one queue and database: its environment (``BENCH_QUEUE``,
    ``BENCH_DATABASE_URL``, ...), its ``python -m`` arguments, what the report notes about it, and
    how many consumers it opens on its queue once it is ready."""

    env: dict[str, str]
    worker_argv: list[str]
    extra: dict[str, object]
    consumers: int


def celery_peer(infra: Infra, name: str, dsn: str, *, prefetch: int, concurrency: int = 2) -> Peer:
    env = infra.child_env(
        {
            "BENCH_AMQP_URL": infra.amqp_url,
            "BENCH_DATABASE_URL": dsn,
            "BENCH_QUEUE": name,
            "BENCH_PREFETCH": str(prefetch),
            "BENCH_CONCURRENCY": str(concurrency),
        }
    )
    argv = [
        "celery",
        "-A",
        "bench.celery_app",
        "worker",
        "--pool=prefork",
        f"--concurrency={concurrency}",
        f"--queues={name}",
        "--without-gossip",
        "--without-mingle",
        "--without-heartbeat",
        "--loglevel=WARNING",
        f"--hostname={name}@%h",
    ]
    # One consumer, in the parent process: the children only run tasks.
    return Peer(env, argv, {"prefetch": prefetch}, consumers=1)


def dramatiq_peer(
    infra: Infra, name: str, dsn: str, *, prefetch: int, processes: int = 2, threads: int = 4
) -> Peer:
    per_process = max(1, math.ceil(prefetch / processes))
    env = infra.child_env(
        {
            "BENCH_AMQP_URL": infra.amqp_url,
            "BENCH_DATABASE_URL": dsn,
            "BENCH_QUEUE": name,
            "dramatiq_queue_prefetch": str(per_process),
        }
    )
    argv = ["dramatiq", "bench.dramatiq_app", f"--processes={processes}", f"--threads={threads}"]
    # Each process consumes the work queue (and its delay queue).
    return Peer(env, argv, {"prefetch_per_process": per_process}, consumers=processes)


async def celery_throughput(
    infra: Infra, workload: Workload, run: int, *, prefetch: int
) -> Measurement:
    name = infra.name(f"celery{run}")
    dsn = await infra.create_database(name, workload)
    await infra.note_celery_delayed_delivery()
    try:
        return await _peer_throughput(
            infra,
            workload,
            Measurement("celery", run, workload.events),
            app="bench.celery_app",
            peer=celery_peer(infra, name, dsn, prefetch=prefetch),
        )
    finally:
        await infra.remove_celery_delayed_delivery()


async def dramatiq_throughput(
    infra: Infra, workload: Workload, run: int, *, prefetch: int
) -> Measurement:
    name = infra.name(f"dramatiq{run}")
    dsn = await infra.create_database(name, workload)
    return await _peer_throughput(
        infra,
        workload,
        Measurement("dramatiq", run, workload.events),
        app="bench.dramatiq_app",
        peer=dramatiq_peer(infra, name, dsn, prefetch=prefetch),
    )


# -- the service's latency ----------------------------------------------------------------------

# How publish -> commit is measured. The service's own columns cannot tell: received_at and
# created_at default to now(), the *start* of the transaction. So the bench database gets a
# deferred constraint trigger on stock_movements: it fires at COMMIT (after every statement of the
# transaction, batch or not, just before the commit record is written) and stores
# clock_timestamp() in an unlogged side table (no WAL, a few microseconds per event). Latency =
# that time - the publish time the harness stamped into the envelope's occurred_at (the same
# machine clock). It misses only the commit's WAL flush (about 0.1 ms here: pg_test_fsync). The
# service's own consumer_event_lag_seconds histogram (occurred_at to just after the commit
# returns) is reported next to it as a cross-check; its buckets are coarse (5, 10, 25, 50 ms...),
# so its quantiles are interpolated within a bucket.
COMMIT_CLOCK = """
CREATE UNLOGGED TABLE bench_commits (
    event_id uuid NOT NULL, committed_at timestamptz NOT NULL, started_at timestamptz NOT NULL
);
CREATE FUNCTION bench_commit_clock() RETURNS trigger LANGUAGE plpgsql AS $$
BEGIN
    -- now(): the start of the applying transaction, for every system alike.
    INSERT INTO bench_commits VALUES (NEW.event_id, clock_timestamp(), now());
    RETURN NULL;
END $$;
CREATE CONSTRAINT TRIGGER bench_commit_clock AFTER INSERT ON stock_movements
    DEFERRABLE INITIALLY DEFERRED FOR EACH ROW EXECUTE FUNCTION bench_commit_clock();
"""


def quantile(sorted_values: list[float], q: float) -> float:
    """Nearest-rank quantile of already sorted values."""
    if not sorted_values:
        return math.nan
    rank = max(1, math.ceil(q * len(sorted_values)))
    return sorted_values[min(rank, len(sorted_values)) - 1]


def histogram_quantile(buckets: list[tuple[float, float]], q: float) -> float:
    """Prometheus-style quantile from cumulative (upper bound, count) buckets, interpolated."""
    if not buckets or buckets[-1][1] <= 0:
        return math.nan
    total = buckets[-1][1]
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in buckets:
        if count >= rank:
            if math.isinf(bound):
                return lower_bound
            if count == lower_count:
                return bound
            return lower_bound + (bound - lower_bound) * (rank - lower_count) / (
                count - lower_count
            )
        lower_bound, lower_count = bound, count
    return lower_bound


CHOICE_GAUGES = ("consumer_workers", "consumer_batch_size")


async def gauges(port: int, names: Sequence[str]) -> dict[str, float]:
    """The service's ``names`` gauges, from its ``/metrics``."""
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=10)
        ) as response,
    ):
        text = await response.text()
    found = {}
    for family in text_string_to_metric_families(text):
        if family.name in names:
            for sample in family.samples:
                found[family.name] = sample.value
    return found


async def _lag_buckets(port: int) -> list[tuple[float, float]]:
    async with (
        aiohttp.ClientSession() as session,
        session.get(
            f"http://127.0.0.1:{port}/metrics", timeout=aiohttp.ClientTimeout(total=10)
        ) as response,
    ):
        text = await response.text()
    buckets = []
    for family in text_string_to_metric_families(text):
        if family.name != "consumer_event_lag_seconds":
            continue
        for sample in family.samples:
            if sample.name.endswith("_bucket") and sample.labels.get("type") == EVENT_TYPE:
                buckets.append((float(sample.labels["le"]), sample.value))
    return sorted(buckets)


async def wait_ready(child: Child, port: int, limit_s: float = 60) -> None:
    deadline = time.monotonic() + limit_s
    async with aiohttp.ClientSession() as session:
        while True:
            if child.exited() is not None:
                raise BenchError(f"the service exited {child.exited()}:\n{child.log_tail()}")
            try:
                async with session.get(
                    f"http://127.0.0.1:{port}/readyz", timeout=aiohttp.ClientTimeout(total=2)
                ) as response:
                    if response.status == 200:
                        return
            except (aiohttp.ClientError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise BenchError(f"the service was not ready within {limit_s}s")
            await asyncio.sleep(0.1)


async def wait_for_consumers(infra: Infra, child: Child, queue: str, count: int) -> None:
    """Until ``queue`` has ``count`` consumers (the system is ready to take what is published),
    or :class:`BenchError` if the process exits or a minute passes."""
    deadline = time.monotonic() + 60
    while True:
        if child.exited() is not None:
            raise BenchError(f"{child.label} exited {child.exited()}:\n{child.log_tail()}")
        with contextlib.suppress(aiormq.exceptions.ChannelNotFoundEntity):
            if await infra.consumer_count(queue) >= count:
                return
        if time.monotonic() > deadline:
            raise BenchError(f"{child.label} did not consume from {queue} within 60s")
        await asyncio.sleep(0.2)


LATENCY_SYSTEMS = ("service", "celery", "dramatiq")


@dataclass
class _Target:
    """A system ready to be started for a latency run: what to spawn, where its messages go."""

    env: dict[str, str]
    argv: list[str]
    wire: Wire
    queue: str
    consumers: int
    metrics_port: int | None = None


async def _latency_target(
    infra: Infra,
    system: str,
    name: str,
    dsn: str,
    *,
    service_env: Mapping[str, str],
    prefetch: int,
) -> _Target:
    if system == "service":
        env = infra.child_env({**service_env, **owned_env(infra, name, dsn)})
        await infra.run_module("topology", "apply", env=env)
        return _Target(
            env,
            [sys.executable, "-m", "consumer", "run"],
            wire.service(f"{name}.events"),
            f"{name}.work",
            1,
            metrics_port=int(env["CONSUMER_HTTP_PORT"]),
        )
    if system == "celery":
        await infra.note_celery_delayed_delivery()
        peer = celery_peer(infra, name, dsn, prefetch=prefetch)
        publish_as = wire.celery(name)
    elif system == "dramatiq":
        peer = dramatiq_peer(infra, name, dsn, prefetch=prefetch)
        publish_as = wire.dramatiq(name)
    else:
        raise BenchError(f"no latency run for {system!r}")
    argv = [sys.executable, "-m", *peer.worker_argv]
    return _Target(peer.env, argv, publish_as, name, peer.consumers)


async def latency(
    infra: Infra,
    workload: Workload,
    run: int,
    *,
    system: str,
    rate: float,
    seconds: float,
    warmup: float,
    service_env: Mapping[str, str],
    prefetch: int,
    label: str | None = None,
) -> Measurement:
    """Start ``system`` on an empty queue, publish to it at a paced ``rate`` for ``seconds`` (its
    own message format, the same publisher for all), and take publish -> commit quantiles.
    ``label``: the run's names (database, queues, log), when the system and rate do not tell
    runs apart."""
    result = Measurement(system, run, 0)
    name = infra.name(label or f"lat{system[:3]}{round(rate)}r{run}")
    sized = Workload(int(rate * seconds), workload.skus, workload.seed + run)
    dsn = await infra.create_database(name, sized)
    try:
        conn = await asyncpg.connect(dsn)
        try:
            await conn.execute(COMMIT_CLOCK)
        finally:
            await conn.close()
        target = await _latency_target(
            infra, system, name, dsn, service_env=service_env, prefetch=prefetch
        )
        child = Child.spawn(system, target.argv, target.env, infra.log_file(f"lat-{name}"))
        buckets: list[tuple[float, float]] = []

        async def scrape() -> None:
            if target.metrics_port is not None:
                buckets.extend(await _lag_buckets(target.metrics_port))

        try:
            await wait_for_consumers(infra, child, target.queue, target.consumers)
            watch = procfs.CpuWatch(cpu_groups(child.pid, name))
            watch.start(time.time())
            own_before = _own_cpu()
            published = await paced_publish(infra.amqp_url, target.wire, sized, rate, seconds)
            finished = time.time()
            window_cpu = watch.stop(finished)
            window_cpu["harness"] = round(
                100 * (_own_cpu() - own_before) / (finished - watch.started_at), 1
            )
            result.events = len(published)
            await drain(child, dsn, name, len(published), result, before_stop=scrape)
            result.cpu = window_cpu
        finally:
            await child.stop()
        effects = await check_effects(dsn, system if system != "service" else name, len(published))
        conn = await asyncpg.connect(dsn)
        try:
            rows = await conn.fetch(
                "SELECT event_id, extract(epoch FROM committed_at)::float8 AS t, "
                "extract(epoch FROM started_at)::float8 AS s FROM bench_commits"
            )
        finally:
            await conn.close()
    finally:
        await infra.drop_database(name)
        await infra.sweep_broker(name)
        if system == "celery":
            await infra.remove_celery_delayed_delivery()
    result.rate = rate
    result.extra = {
        **latency_figures(published, {row["event_id"]: row["t"] for row in rows}, warmup),
        **start_figures(published, {row["event_id"]: row["s"] for row in rows}, warmup),
        **effects,
    }
    if buckets:
        result.extra["histogram_p50_ms"] = round(histogram_quantile(buckets, 0.50) * 1000, 2)
        result.extra["histogram_p99_ms"] = round(histogram_quantile(buckets, 0.99) * 1000, 2)
    return result


def start_figures(
    published: Mapping[uuid.UUID, float], started: Mapping[uuid.UUID, float], warmup: float
) -> dict[str, Any]:
    """Publish -> the start of the transaction that applied the event (``now()`` in it), in ms:
    p50 and p99 of the events published ``warmup`` seconds or more after the first."""
    if not published:
        return {"start_p50_ms": None, "start_p99_ms": None}
    first = min(published.values())
    waits = sorted(
        (started[event_id] - at) * 1000
        for event_id, at in published.items()
        if at - first >= warmup and event_id in started
    )
    return {
        "start_p50_ms": round(quantile(waits, 0.50), 2),
        "start_p99_ms": round(quantile(waits, 0.99), 2),
    }


def latency_figures(
    published: Mapping[uuid.UUID, float], committed: Mapping[uuid.UUID, float], warmup: float
) -> dict[str, Any]:
    """Publish -> commit in ms of the events published ``warmup`` seconds or more after the first:
    p50, p99 and max, how many, the rate the publisher achieved, and the backlog: the events not
    yet committed when the last one was published (from the commit clock, so it does not count
    what committed while the publisher waited for its last confirms)."""
    if not published:
        return {"published_rate": None, "samples": 0, "p50_ms": None, "p99_ms": None}
    start, end = min(published.values()), max(published.values())
    committed_by_end = sum(1 for event_id in published if committed.get(event_id, math.inf) <= end)
    latencies = sorted(
        (committed[event_id] - at) * 1000
        for event_id, at in published.items()
        if at - start >= warmup and event_id in committed
    )
    return {
        "published_rate": round((len(published) - 1) / (end - start), 1) if end > start else None,
        "backlog_at_end": len(published) - committed_by_end,
        "samples": len(latencies),
        "p50_ms": round(quantile(latencies, 0.50), 2),
        "p99_ms": round(quantile(latencies, 0.99), 2),
        "max_ms": round(latencies[-1], 2) if latencies else None,
    }
