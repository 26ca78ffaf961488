"""Scale-out on a RabbitMQ cluster as a user would do it: 1 service process, then 3, each given the
node list starting at another node (so each is connected to a different node), on a throwaway
three-node cluster (``tests.servers.ThrowawayRabbitCluster``) and the local PostgreSQL.

    .venv/bin/python -m bench.cluster_scale --events 20000 --runs 1

Per run and process count: a fresh name (queues) and database, the quorum work queue replicated on
the three nodes, ``inventory.restock`` events spread over ``--skus`` stock rows, all published and
confirmed first, then the processes started; the rate is
from the first effect committed to the last (``stock_movements`` polled every 50 ms), as
``make bench`` times the service. Exactly once is checked after each run. No timing assertion: the
figures are printed, for bench/README.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
import uuid
from pathlib import Path

from tests.conftest import drop_database, make_template
from tests.servers import ThrowawayRabbitCluster, free_port
from tests.support import (
    Event,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    fetchval,
    movements,
)

ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
POLL_S = 0.05
SHAPES = (
    ("1 process on the leader's node", 1, 0),
    ("1 process on another node", 1, 1),
    ("3 processes, one per node", 3, 0),
)
"""(label, processes, the node the first one is connected to)."""


def restocks(count: int, skus: int) -> list[Event]:
    """Restocks spread over ``skus`` stock rows: two transactions that restock one SKU wait for
    each other, and only within one process are equal SKUs kept to one worker."""
    return [
        ("inventory.restock", {"sku": f"SKU-{n % skus}", "qty": 1}, uuid.uuid4())
        for n in range(count)
    ]


async def restock_rate(dsn: str, events: int) -> float:
    """Restocks a second, from the first effect committed to the last of ``events``
    (``stock_movements`` polled every :data:`POLL_S`)."""
    first: float | None = None
    while (done := await movements(dsn)) < events:
        if done and first is None:
            first = time.monotonic()
        await asyncio.sleep(POLL_S)
    last = time.monotonic()
    return events / (last - (first or last) or POLL_S)


def rotated(urls: list[str], start: int) -> str:
    return ",".join(urls[start:] + urls[:start])


async def one_run(
    cluster: ThrowawayRabbitCluster,
    processes: int,
    events: int,
    skus: int,
    logs: Path,
    first_node: int = 0,
) -> float:
    """Events a second applied by ``processes`` service processes, one per node from
    ``first_node`` on (the queues' leader is the first node, which declared them)."""
    name = f"scale{uuid.uuid4().hex[:6]}"
    database = name
    await make_template(ADMIN_DSN, database)
    env = TestEnv(
        name=name,
        database_url=ADMIN_DSN.rsplit("/", 1)[0] + "/" + database,
        amqp_url=cluster.url_list,
        http_port=free_port(),
        log_dir=logs,
        overrides={"quorum_initial_group_size": "3", "log_level": "WARNING"},
    )
    services: list[ServiceProcess] = []
    try:
        await env.apply_topology()
        batch = restocks(events, skus)
        async with env.producer(cluster.urls[0]) as producer:
            await producer.send_many(batch)
        services = [
            ServiceProcess(
                env,
                f"{name}-{index}",
                http_port=str(free_port()),
                amqp_url=rotated(cluster.urls, (first_node + index) % len(cluster.urls)),
            )
            for index in range(processes)
        ]
        for service in services:
            service.start()
        rate = await restock_rate(env.database_url, events)
        await asyncio.gather(*(service.wait_idle(timeout=60) for service in services))
        await assert_applied_once(env.database_url, [i for _, _, i in batch], "stock_movements")
        assert await fetchval(env.database_url, "SELECT sum(available) FROM stock") == events
        return rate
    finally:
        for service in services:
            if service.running:
                await service.stop()
        await env.cleanup_broker()
        await drop_database(ADMIN_DSN, database)


async def measure(events: int, skus: int, runs: int, logs: Path) -> dict[str, list[float]]:
    cluster = ThrowawayRabbitCluster()
    try:
        await asyncio.to_thread(cluster.start)
        print(f"cluster started in {cluster.start_seconds:.1f}s", file=sys.stderr)
        rates: dict[str, list[float]] = {shape: [] for shape, _, _ in SHAPES}
        for run in range(runs):  # interleaved, so slow phases of the machine hit all
            for shape, processes, first_node in SHAPES:
                rate = await one_run(cluster, processes, events, skus, logs, first_node)
                rates[shape].append(rate)
                print(f"run {run + 1}: {shape}: {rate:,.0f}/s", file=sys.stderr)
        return rates
    finally:
        await asyncio.to_thread(cluster.destroy)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--skus", type=int, default=100, help="stock rows the restocks spread over")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--logs", type=Path, default=Path("/tmp/cluster-scale-logs"))
    arguments = parser.parse_args()
    arguments.logs.mkdir(parents=True, exist_ok=True)
    rates = asyncio.run(measure(arguments.events, arguments.skus, arguments.runs, arguments.logs))
    summary = {
        f"{shape}, events/s (median)": round(statistics.median(values))
        for shape, values in rates.items()
    }
    print(
        json.dumps({"events": arguments.events, "skus": arguments.skus, "runs": rates, **summary})
    )


if __name__ == "__main__":
    main()
