"""Queue isolation (the queue table, issue 32): the rate of a queue of fast, database-only events
alone, and beside a queue whose handler awaits 2 s, both served by one process.

    .venv/bin/python -m bench.queue_isolation --events 20000 --runs 2

Per run: a fresh name (queues) and database, the table below applied, ``inventory.restock``
events published and confirmed first (and, beside, ``--slow`` events of ``test.behave`` that each
await ``--slow-seconds``), then one ``consumer run`` started; the fast queue's rate is from its
first effect committed to its last (``stock_movements`` polled every 50 ms), as ``make bench``
times the service. Exactly once is checked after each run. The runs alternate (alone, beside) so
that slow phases of the machine hit both. No timing assertion: the figures are printed, for
docs/guide/queue-table.md.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import uuid
from pathlib import Path

from bench.cluster_scale import restock_rate, restocks
from tests.conftest import drop_database, make_template
from tests.servers import free_port
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    run_cli,
)

ADMIN_DSN = "postgresql://postgres@127.0.0.1:5432/postgres"
AMQP_URL = "amqp://guest:guest@127.0.0.1:5672/"
TABLE = """
[queues.fast]
types = ["inventory.restock", "inventory.reserve", "notification.requested"]

[queues.slow]
types = ["test.behave", "test.behave_many", "test.odd"]
prefetch = 50
db_pool_size = 4
handler_timeout = "1m"
hard_timeout = "2m"
"""


async def one_run(events: int, slow: int, slow_seconds: float, logs: Path) -> float:
    """The fast queue's events a second, with ``slow`` slow events in the other queue."""
    name = f"iso{uuid.uuid4().hex[:6]}"
    await make_template(ADMIN_DSN, name)
    env = TestEnv(
        name=name,
        database_url=ADMIN_DSN.rsplit("/", 1)[0] + "/" + name,
        amqp_url=AMQP_URL,
        http_port=free_port(),
        log_dir=logs,
        overrides={"log_level": "WARNING", "shutdown_grace": "1s"},
    )
    service: ServiceProcess | None = None
    try:
        env.use_queue_table(TABLE, logs)
        applied = run_cli("topology", "apply", env=env.env())
        assert applied.returncode == 0, applied.stderr
        batch = restocks(events, 100)
        async with env.producer() as producer:
            await producer.send_many(batch)
            await producer.send_many(
                ("test.behave", behave(f"s{n}", sleep_s=slow_seconds), uuid.uuid4())
                for n in range(slow)
            )
        service = ServiceProcess(env, name).start()
        rate = await restock_rate(env.database_url, events)
        await assert_applied_once(env.database_url, [i for _, _, i in batch], "stock_movements")
        return rate
    finally:
        if service is not None and service.running:
            await service.stop()
        await env.cleanup_broker()
        await drop_database(ADMIN_DSN, name)


async def measure(
    events: int, slow: int, slow_seconds: float, runs: int, logs: Path
) -> dict[str, list[float]]:
    rates: dict[str, list[float]] = {"alone": [], "beside": []}
    for run in range(runs):
        for shape, count in (("alone", 0), ("beside", slow)):
            rate = await one_run(events, count, slow_seconds, logs)
            rates[shape].append(rate)
            print(f"run {run + 1}: fast queue {shape}: {rate:,.0f}/s", file=sys.stderr)
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--events", type=int, default=20_000, help="fast events per run")
    parser.add_argument("--slow", type=int, default=500, help="slow events beside")
    parser.add_argument("--slow-seconds", type=float, default=2.0, help="each slow event's await")
    parser.add_argument("--runs", type=int, default=2)
    arguments = parser.parse_args()
    with tempfile.TemporaryDirectory() as logs:
        rates = asyncio.run(
            measure(
                arguments.events, arguments.slow, arguments.slow_seconds, arguments.runs, Path(logs)
            )
        )
    alone, beside = statistics.median(rates["alone"]), statistics.median(rates["beside"])
    print(json.dumps({"rates": rates, "alone": alone, "beside": beside}, indent=2))
    print(f"fast queue beside the slow one keeps {beside / alone:.2f} of its rate alone")


if __name__ == "__main__":
    main()
