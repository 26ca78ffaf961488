"""Sharded queues on a three-node cluster (issue 36, "Measure"): throughput of 1, 3 and 6 service
processes draining a queue of 1, 3 and 6 shards, the same events in every cell, in one run.

    make bench-shards
    .venv/bin/python -m bench.shards --events 15000 --processes 1,3,6 --shards 1,3,6

A throwaway three-node RabbitMQ cluster (``tests.servers.ThrowawayRabbitCluster``, the
consistent-hash exchange's plugin enabled on each node, Erlang's scheduler busy-waiting off so
the nodes' CPU is work, not spinning) and the local PostgreSQL. Per cell (processes x shards),
processes outer, shards inner, so the cells compared at one process count run back to back:

- a name and database of its own (a copy of one template, stocked so no reservation fails), a
  queue table whose ``stock`` queue has that many shards (1: the plain work queue), replicated on
  the three nodes, applied by ``python -m topology apply``; the shards' leaders are recorded;
- the backlog published and confirmed through the first node: ``--events`` ``inventory.reserve``
  events (the reference batch handler) of :class:`bench.events.Workload` (the same ids, SKUs and
  order ids in every cell), each with ``consumer-shard-key`` set to its SKU as ``consumer
  publish`` sets it; the nodes' CPU while publishing is kept (the enqueue's cost);
- the processes started together, process ``i`` connected to node ``i mod 3`` (its
  ``CONSUMER_AMQP_URL`` starts there), with ``--shards`` from
  :func:`bench.shard_figures.assign_shards`;
- **the rate**: events committed (``stock_movements`` counted every 50 ms) from the moment
  every process is ready (``/readyz`` 200), so no process's start-up is in it, to the moment
  only :func:`window_end`'s tail is left (15% of the events, or more while the consumers'
  prefetch windows hold more): the steady state, before the shards run dry one by one. The rate
  of the whole drain (first effect to last, the tail included) is kept too. CPU over the
  window from ``/proc``: the service processes, each node's beam, the run database's backends
  (the harness's polling backend taken out), the harness, the machine; the load average at the
  cell's start and end;
- after: exactly once checked (a receipt and a movement per event, the stock down by as many),
  the effect transactions counted (distinct receipts' transaction start times: events per
  commit), ``xact_commit`` of ``pg_stat_database`` over the whole cell (start-up and readiness
  probes included), the cell's queues and exchanges deleted, its database dropped.

Results go to ``bench/results/shards-<time>.{json,txt}``; the last stdout line is the summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp
import asyncpg
from aio_pika.abc import DeliveryMode

from bench import procfs, report
from bench.cli import _common, _positive_ints, _service_env
from bench.events import EVENT_TYPE, Workload, encode
from bench.infra import BenchError, Child, Infra, free_port
from bench.measure import check_effects
from bench.run import machine, progress
from bench.shard_figures import assign_shards, consumer_channels, shard_lines, shards_label
from tests.servers import ThrowawayRabbitCluster
from topology.names import SHARD_KEY

__all__ = ["main", "queue_table", "rotated", "run_shards", "window_end"]

PROCESSES = (1, 3, 6)
SHARDS = (1, 3, 6)
EVENTS = 15_000
SKUS = 10_000
"""Keys: enough that two batches of 50 in different processes seldom lock the same stock row
(with 100 SKUs they mostly wait on each other: bench/README.md, Scale-out on a cluster), so a
cell measures shards and processes, not row locks."""
POLL_S = 0.05
TAIL_SHARE = 0.15
STALL_S = 90.0
READY_LIMIT_S = 120.0
ERL_ARGS = "+sbwt none +sbwtdcpu none +sbwtdio none"
"""No scheduler busy-waiting: three nodes on two shared cores would spin on each other's time,
and the nodes' CPU figures would count the spinning as work."""
PLUGINS = "[rabbitmq_consistent_hash_exchange].\n"


def queue_table(shards: int) -> str:
    """The reference handlers' queue table, the stock queue in ``shards`` shards."""
    stock = f"shards = {shards}\n" if shards > 1 else ""
    return (
        '[queues.stock]\ntypes = ["inventory.restock", "inventory.reserve"]\n'
        f"{stock}"
        '[queues.notify]\ntypes = ["notification.requested"]\n'
    )


def window_end(events: int, channels: int, prefetch: int) -> int:
    """Where the measured window ends: while at least :data:`TAIL_SHARE` of the events, and
    half again the consumers' windows (``channels`` x ``prefetch``), are still to be applied,
    the queues still hold events. Until then the prefetched deliveries the processes hold stay
    about as many as at the window's start, so what was committed in the window is what the
    broker delivered in it; after it the queues run dry one by one (the shards do not hold the
    same number of events) and the rate falls to the last shard's."""
    left = max(math.ceil(events * TAIL_SHARE), math.ceil(1.5 * channels * prefetch))
    return max(events - left, 0)


def _prefetch(env: Mapping[str, str]) -> int:
    return int(env.get("CONSUMER_PREFETCH") or 400)


def rotated(urls: Sequence[str], start: int) -> str:
    """The node list starting at node ``start``: the process connects there first."""
    start %= len(urls)
    return ",".join([*urls[start:], *urls[:start]])


@dataclass(frozen=True, slots=True)
class ShardsOptions:
    events: int
    skus: int
    seed: int
    processes: tuple[int, ...]
    shards: tuple[int, ...]
    admin_dsn: str
    results_dir: Path
    keep_logs: bool = False
    service_env: Mapping[str, str] = field(default_factory=dict)


# -- the cluster --------------------------------------------------------------------------------


def _start_cluster(folder: Path) -> ThrowawayRabbitCluster:
    plugins = folder / "enabled_plugins"
    plugins.write_text(PLUGINS)
    cluster = ThrowawayRabbitCluster(erl_args=ERL_ARGS)
    for node in cluster.nodes:
        node.add_file("enabled_plugins", plugins, mode=0o644)
    try:
        cluster.start()
    except BaseException:
        cluster.destroy()
        raise
    return cluster


def _ctl_json(cluster: ThrowawayRabbitCluster, *args: str) -> list[dict[str, Any]]:
    result = subprocess.run(
        [*cluster.nodes[0].ctl_command(), *args, "--formatter", "json"],
        capture_output=True,
        text=True,
        check=False,
        timeout=60,
        cwd="/",
    )
    if result.returncode != 0:
        raise BenchError(f"rabbitmqctl {' '.join(args)}: {result.stderr.strip()[:300]}")
    rows = json.loads(result.stdout or "[]")
    return [row for row in rows if isinstance(row, dict)]


def _leaders(cluster: ThrowawayRabbitCluster, queues: Sequence[str]) -> dict[str, int]:
    """Each queue's leader's node index, from one ``list_queues``."""
    nodes = {node.node: index for index, node in enumerate(cluster.nodes)}
    rows = _ctl_json(cluster, "list_queues", "name", "leader")
    return {
        str(row["name"]): nodes.get(str(row.get("leader")), -1)
        for row in rows
        if row.get("name") in queues
    }


async def _delete_broker_objects(cluster: ThrowawayRabbitCluster, name: str) -> None:
    """Every queue and exchange called ``name.*`` (listed by ``rabbitmqctl``: all the topology
    declared), deleted through the first node."""

    def ours(rows: list[dict[str, Any]]) -> list[str]:
        return [str(row["name"]) for row in rows if str(row.get("name", "")).startswith(name)]

    queues = ours(await asyncio.to_thread(_ctl_json, cluster, "list_queues", "name"))
    exchanges = ours(await asyncio.to_thread(_ctl_json, cluster, "list_exchanges", "name"))
    connection = await aio_pika.connect(cluster.urls[0])
    try:
        channel = await connection.channel()
        for queue in queues:
            await channel.queue_delete(queue)
        for exchange in exchanges:
            await channel.exchange_delete(exchange)
    finally:
        await connection.close()


# -- one cell -----------------------------------------------------------------------------------


async def _publish(url: str, exchange_name: str, workload: Workload, window: int = 1000) -> None:
    """The workload's events with confirms, ``window`` in flight, each keyed by its SKU."""
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        exchange = await channel.get_exchange(exchange_name, ensure=False)
        pending: list[Any] = []
        for event in workload.envelopes():
            message = aio_pika.Message(
                encode(event),
                content_type="application/json",
                delivery_mode=DeliveryMode.PERSISTENT,
                headers={SHARD_KEY: event["payload"]["sku"]},
            )
            pending.append(exchange.publish(message, routing_key=EVENT_TYPE, timeout=120))
            if len(pending) >= window:
                await asyncio.gather(*pending)
                pending = []
        await asyncio.gather(*pending)
    finally:
        await connection.close()


async def _depths(url: str, queues: Sequence[str]) -> list[int]:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        depths = []
        for queue in queues:
            declared = await channel.declare_queue(queue, passive=True)
            depths.append(int(declared.declaration_result.message_count or 0))
        return depths
    finally:
        await connection.close()


async def _ready(session: aiohttp.ClientSession, port: int) -> bool:
    try:
        async with session.get(
            f"http://127.0.0.1:{port}/readyz", timeout=aiohttp.ClientTimeout(total=1)
        ) as response:
            return response.status == 200
    except (aiohttp.ClientError, TimeoutError):
        return False


async def _xact_commit(admin_dsn: str, database: str) -> int:
    conn = await asyncpg.connect(admin_dsn)
    try:
        value = await conn.fetchval(
            "SELECT xact_commit FROM pg_stat_database WHERE datname = $1", database
        )
        return int(value or 0)
    finally:
        await conn.close()


async def _transactions(dsn: str) -> dict[str, Any]:
    """The effect transactions: receipts grouped by their transaction's start (``received_at``
    is ``now()``), with the batch sizes' spread."""
    conn = await asyncpg.connect(dsn)
    try:
        sizes = [
            int(row["n"])
            for row in await conn.fetch(
                "SELECT count(*) AS n FROM receipts GROUP BY received_at ORDER BY n"
            )
        ]
    finally:
        await conn.close()
    if not sizes:
        return {"transactions": 0}
    return {
        "transactions": len(sizes),
        "batch_median": sizes[len(sizes) // 2],
        "batch_max": sizes[-1],
        "batch_full_share": round(sum(n for n in sizes if n >= 50) / sum(sizes), 3),
    }


def _cpu(
    watch: procfs.CpuWatch, now: float, services: int, nodes: int, poll: bool
) -> dict[str, float]:
    """The watch's figures with the processes and nodes summed, the poll backend taken out."""
    raw = watch.stop(now)
    cpu = dict(raw)
    if services:
        cpu["service"] = round(sum(raw.get(f"svc{i}", 0.0) for i in range(services)), 1)
    cpu["beam"] = round(sum(raw.get(f"beam{i}", 0.0) for i in range(nodes)), 1)
    if poll:
        cpu["postgres"] = round(raw.get("postgres", 0.0) - raw.get("poll", 0.0), 1)
    return {k: v for k, v in cpu.items() if not k.startswith("svc")}


async def _drain(
    children: Sequence[Child],
    ports: Sequence[int],
    cluster: ThrowawayRabbitCluster,
    dsn: str,
    database: str,
    events: int,
    window_end: int,
) -> dict[str, Any]:
    """Poll until every event is committed. The measured window: from the moment every process
    is ready to the moment ``window_end`` events are committed (its rate, CPU and commits)."""
    conn = await asyncpg.connect(dsn)
    poll_pid = conn.get_server_pid()
    groups: dict[str, procfs.ProcessGroup] = {
        f"svc{i}": child.pid for i, child in enumerate(children)
    }
    for index, node in enumerate(cluster.nodes):
        pid = node.beam_pid()
        if pid is not None:
            groups[f"beam{index}"] = pid
    groups["postgres"] = procfs.Named("postgres", cmdline_contains=f" {database} ")
    groups["poll"] = poll_pid
    watch = procfs.CpuWatch(groups)
    ready: set[int] = set()
    first: tuple[float, int] | None = None
    start: tuple[float, int, float] | None = None  # monotonic, committed, harness CPU
    out: dict[str, Any] = {}
    last_change, last_count = time.monotonic(), -1
    next_sample = 0.0
    try:
        async with aiohttp.ClientSession() as session:
            while True:
                count = int(await conn.fetchval("SELECT count(*) FROM stock_movements"))
                now = time.monotonic()
                if count and first is None:
                    first = (now, count)
                if start is None:
                    for index, port in enumerate(ports):
                        if index not in ready and await _ready(session, port):
                            ready.add(index)
                    if len(ready) == len(ports):
                        count = int(await conn.fetchval("SELECT count(*) FROM stock_movements"))
                        now = time.monotonic()
                        if count >= window_end:
                            raise BenchError(
                                f"{count} of {events} events applied before every process was "
                                "ready: more --events"
                            )
                        start = (now, count, time.process_time())
                        watch.start(now)
                        next_sample = now + 2
                elif "rate" not in out and count >= window_end:
                    seconds = max(now - start[0], POLL_S)
                    cpu = _cpu(watch, now, len(children), len(cluster.nodes), poll=True)
                    cpu["harness"] = round(100 * (time.process_time() - start[2]) / seconds, 1)
                    out.update(
                        {
                            "rate": round((count - start[1]) / seconds, 1),
                            "window": [start[1], count],
                            "window_s": round(seconds, 2),
                            "cpu": cpu,
                        }
                    )
                elif "rate" not in out and now >= next_sample:
                    watch.sample()
                    next_sample = now + 2
                if count >= events:
                    break
                if count != last_count:
                    last_change, last_count = now, count
                elif now - last_change > STALL_S:
                    raise BenchError(f"no progress for {STALL_S:.0f}s at {count}/{events}")
                for child in children:
                    if child.exited() is not None:
                        raise BenchError(
                            f"{child.label} exited {child.exited()} at {count}/{events}:\n"
                            + child.log_tail()
                        )
                if start is None and first is not None and now - first[0] > READY_LIMIT_S:
                    raise BenchError(f"not every process ready within {READY_LIMIT_S:.0f}s")
                await asyncio.sleep(POLL_S)
    finally:
        await conn.close()
    end = time.monotonic()
    assert first is not None
    out["first_to_last_rate"] = round((events - first[1]) / max(end - first[0], POLL_S), 1)
    return out


async def _cell(
    cluster: ThrowawayRabbitCluster,
    infra: Infra,
    options: ShardsOptions,
    workload: Workload,
    template: str,
    processes: int,
    shards: int,
) -> dict[str, Any]:
    name = infra.name(f"p{processes}s{shards}")
    assignment = assign_shards(processes, shards)
    cell: dict[str, Any] = {
        "processes": processes,
        "shards": shards,
        "assignment": shards_label(assignment),
        "events": workload.events,
        "load": [os.getloadavg()[0]],
    }
    dsn = await infra.create_database(name, workload, template=template)
    table = infra.log_dir / f"{name}.toml"
    table.write_text(queue_table(shards))
    base = infra.child_env(
        {
            **options.service_env,
            "CONSUMER_NAME": name,
            "CONSUMER_EXCHANGE": f"{name}.events",
            "CONSUMER_DATABASE_URL": dsn,
            "CONSUMER_AMQP_URL": cluster.url_list,
            "CONSUMER_QUEUES_FILE": str(table),
            "CONSUMER_QUORUM_INITIAL_GROUP_SIZE": "3",
            "CONSUMER_HTTP_HOST": "127.0.0.1",
            "CONSUMER_LOG_LEVEL": options.service_env.get("CONSUMER_LOG_LEVEL", "WARNING"),
        }
    )
    queues = (
        [f"{name}.stock.work"]
        if shards == 1
        else [f"{name}.stock.work.s{i}" for i in range(1, shards + 1)]
    )
    children: list[Child] = []
    try:
        await infra.run_module("topology", "apply", env=base)
        leaders = await asyncio.to_thread(_leaders, cluster, queues)
        cell["leaders"] = [leaders.get(queue, -1) for queue in queues]
        watch = procfs.CpuWatch(
            {f"beam{i}": pid for i, n in enumerate(cluster.nodes) if (pid := n.beam_pid())}
        )
        began, own = time.monotonic(), time.process_time()
        watch.start(began)
        await _publish(cluster.urls[0], f"{name}.events", workload)
        done = time.monotonic()
        publish_cpu = _cpu(watch, done, 0, len(cluster.nodes), poll=False)
        publish_cpu["harness"] = round(100 * (time.process_time() - own) / (done - began), 1)
        cell["publish"] = {
            "events": workload.events,
            "seconds": round(done - began, 2),
            "cpu": publish_cpu,
        }
        cell["depths"] = await _depths(cluster.urls[0], queues)
        if sum(cell["depths"]) != workload.events:
            raise BenchError(f"{sum(cell['depths'])} of {workload.events} events in the queues")
        commits_before = await _xact_commit(options.admin_dsn, name)
        ports = [free_port() for _ in range(processes)]
        for index, (port, part) in enumerate(zip(ports, assignment, strict=True)):
            env = {
                **base,
                "CONSUMER_AMQP_URL": rotated(cluster.urls, index),
                "CONSUMER_HTTP_PORT": str(port),
            }
            argv = [sys.executable, "-m", "consumer", "run"]
            if part is not None:
                argv += ["--shards", ",".join(map(str, part))]
            children.append(
                Child.spawn(f"{name}-{index}", argv, env, infra.log_file(f"{name}-{index}"))
            )
        channels = consumer_channels(assignment, shards)
        end = window_end(workload.events, channels, _prefetch(base))
        cell.update(await _drain(children, ports, cluster, dsn, name, workload.events, end))
        cell["exit_codes"] = [await child.stop() for child in children]
        children = []
        cell["commits"] = await _xact_commit(options.admin_dsn, name) - commits_before
        await check_effects(dsn, name, workload.events)
        cell.update(await _transactions(dsn))
        cell["load"].append(os.getloadavg()[0])
    finally:
        for child in children:
            await child.stop(grace=10)
        with contextlib.suppress(BenchError, OSError, aio_pika.exceptions.AMQPError):
            await _delete_broker_objects(cluster, f"{name}.")
        await infra.drop_database(name)
    return cell


async def run_shards(options: ShardsOptions) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    infra = Infra.start("", options.admin_dsn, options.results_dir, stamp)
    workload = Workload(options.events, options.skus, options.seed)
    result: dict[str, Any] = {
        "kind": "shards",
        "started": stamp,
        "machine": machine(),
        "events": options.events,
        "skus": options.skus,
        "service_env": dict(options.service_env),
        "cells": [],
    }
    progress(f"shards {infra.prefix}: {result['machine']}")
    infra.log_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    cluster: ThrowawayRabbitCluster | None = None
    try:
        cluster = await asyncio.to_thread(_start_cluster, infra.log_dir)
        progress(f"  cluster started in {cluster.start_seconds or 0:.0f}s")
        template = infra.name("template")
        await infra.create_database(template, workload)
        for processes in options.processes:
            for shards in options.shards:
                try:
                    cell = await _cell(
                        cluster, infra, options, workload, template, processes, shards
                    )
                except BenchError as error:
                    failed = True
                    cell = {"processes": processes, "shards": shards, "error": str(error)}
                progress(
                    f"  {processes} x {shards}: "
                    + json.dumps({k: v for k, v in cell.items() if k != "depths"})
                )
                result["cells"].append(cell)
        result["finished"] = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        result["load_at_end"] = [round(value, 2) for value in os.getloadavg()]
    except BaseException:
        failed = True
        raise
    finally:
        if cluster is not None:
            await asyncio.to_thread(cluster.destroy)
        await infra.drop_all_databases()
        if failed or options.keep_logs:
            result["logs"] = str(infra.log_dir)
        else:
            shutil.rmtree(infra.log_dir, ignore_errors=True)
    return result


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.shards", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--events", type=int, default=EVENTS, help="events in every cell")
    parser.add_argument("--processes", type=_positive_ints, default=PROCESSES)
    parser.add_argument("--shards", type=_positive_ints, default=SHARDS)
    _common(parser)
    parser.set_defaults(skus=SKUS)
    arguments = parser.parse_args(argv)
    if arguments.events < 1 or arguments.skus < 1:
        raise SystemExit("--events and --skus must be at least 1")
    options = ShardsOptions(
        events=arguments.events,
        skus=arguments.skus,
        seed=arguments.seed,
        processes=arguments.processes,
        shards=arguments.shards,
        admin_dsn=arguments.admin_dsn,
        results_dir=arguments.results_dir,
        keep_logs=arguments.keep_logs,
        service_env=_service_env(arguments.service_env),
    )
    try:
        result = asyncio.run(run_shards(options))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    report.publish(result, "\n".join(shard_lines(result)), options.results_dir)
    return 0 if not any(cell.get("error") for cell in result["cells"]) else 1


if __name__ == "__main__":
    sys.exit(main())
