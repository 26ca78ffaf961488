"""What every measurement needs: unique names, fresh databases, topologies, publishing, polling,
child processes, and cleaning all of it up afterwards."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any
from urllib.parse import urlsplit, urlunsplit

import aio_pika
import aiormq
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractConnection, DeliveryMode

from bench import procfs
from bench.events import Workload, sku_name

REPO = Path(__file__).resolve().parent.parent
PGBENCH = Path("/usr/lib/postgresql/15/bin/pgbench")

# Environment variables the harness owns for each service run; --service-env may not set them.
OWNED_SERVICE_ENV = (
    "CONSUMER_NAME",
    "CONSUMER_EXCHANGE",
    "CONSUMER_DATABASE_URL",
    "CONSUMER_AMQP_URL",
    "CONSUMER_HTTP_HOST",
    "CONSUMER_HTTP_PORT",
)


class BenchError(Exception):
    """A measurement could not be made; the message says why."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def dsn_for(admin_dsn: str, database: str) -> str:
    parts = urlsplit(admin_dsn)
    return urlunsplit(parts._replace(path="/" + database))


@contextlib.asynccontextmanager
async def scratch_database(admin_dsn: str, name: str) -> AsyncIterator[str]:
    """A database of its own, ``name``, made from ``admin_dsn`` and dropped (forced) after; its
    DSN."""
    admin = await asyncpg.connect(admin_dsn)
    try:
        await admin.execute(f'CREATE DATABASE "{name}"')
    finally:
        await admin.close()
    try:
        yield dsn_for(admin_dsn, name)
    finally:
        admin = await asyncpg.connect(admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await admin.close()


def find_pgbench() -> str:
    found = shutil.which("pgbench")
    if found:
        return found
    if PGBENCH.exists():
        return str(PGBENCH)
    raise BenchError("pgbench not found (Debian: postgresql-15 ships it in /usr/lib/postgresql)")


@dataclass
class Infra:
    """Names, databases and broker objects of one harness invocation (``bench_<id>``)."""

    run_id: str
    amqp_url: str
    admin_dsn: str
    log_dir: Path
    databases: list[str] = field(default_factory=list)
    celery_delayed_existed: bool | None = None

    @classmethod
    def start(cls, amqp_url: str, admin_dsn: str, results_dir: Path, stamp: str) -> Infra:
        """A new invocation: a random id, its logs in ``results_dir/logs-<stamp>``."""
        return cls(
            run_id=uuid.uuid4().hex[:8],
            amqp_url=amqp_url,
            admin_dsn=admin_dsn,
            log_dir=results_dir / f"logs-{stamp}",
        )

    @property
    def prefix(self) -> str:
        return f"bench_{self.run_id}"

    def name(self, label: str) -> str:
        return f"{self.prefix}_{label}"

    def dsn(self, database: str) -> str:
        return dsn_for(self.admin_dsn, database)

    # -- subprocesses -------------------------------------------------------------------------

    def child_env(self, extra: Mapping[str, str] | None = None) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            part for part in (str(REPO), env.get("PYTHONPATH", "")) if part
        )
        env.update(extra or {})
        return env

    async def run_module(
        self, module: str, *args: str, env: Mapping[str, str], limit_s: float = 300
    ) -> str:
        """``python -m module args``; its output, or :class:`BenchError` with it if it fails."""
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            module,
            *args,
            env=dict(env),
            cwd=REPO,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
        )
        try:
            output, _ = await asyncio.wait_for(process.communicate(), limit_s)
        except TimeoutError:
            process.kill()
            await process.wait()
            raise BenchError(f"python -m {module} {' '.join(args)} timed out") from None
        text = output.decode(errors="replace")
        if process.returncode != 0:
            raise BenchError(
                f"python -m {module} {' '.join(args)} exited {process.returncode}:\n{text[-2000:]}"
            )
        return text

    def log_file(self, label: str) -> Path:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        return self.log_dir / f"{label}.log"

    # -- databases ----------------------------------------------------------------------------

    async def create_database(
        self, database: str, workload: Workload, *, template: str | None = None
    ) -> str:
        """A fresh database: created and migrated by ``python -m consumer migrate
        --create-database``, then stocked with every SKU of the workload; or, given a
        ``template`` made so (and no longer connected to), a copy of it. Returns its DSN."""
        dsn = self.dsn(database)
        self.databases.append(database)
        if template is not None:
            conn = await asyncpg.connect(self.admin_dsn)
            try:
                # A file copy after a checkpoint: WAL_LOG would write the copy to the WAL, and
                # the checkpoint that WAL then calls for could land in the measurement.
                await conn.execute(
                    f'CREATE DATABASE "{database}" TEMPLATE "{template}" STRATEGY = FILE_COPY'
                )
            finally:
                await conn.close()
            return dsn
        await self.run_module(
            "consumer",
            "migrate",
            "--create-database",
            env=self.child_env({"CONSUMER_DATABASE_URL": dsn}),
        )
        conn = await asyncpg.connect(dsn)
        try:
            await conn.executemany(
                "INSERT INTO stock (sku, available) VALUES ($1, $2)",
                [(sku_name(i), workload.stock_per_sku) for i in range(1, workload.skus + 1)],
            )
            await conn.execute("ANALYZE")
        finally:
            await conn.close()
        return dsn

    async def drop_database(self, database: str) -> None:
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        finally:
            await conn.close()
        with contextlib.suppress(ValueError):
            self.databases.remove(database)

    async def drop_all_databases(self) -> None:
        conn = await asyncpg.connect(self.admin_dsn)
        try:
            names = await conn.fetch(
                "SELECT datname FROM pg_database WHERE datname LIKE $1",
                self.prefix.replace("_", r"\_") + r"\_%",
            )
        finally:
            await conn.close()
        for name in {row["datname"] for row in names} | set(self.databases):
            await self.drop_database(name)

    # -- broker -------------------------------------------------------------------------------

    async def publish(
        self, exchange_name: str, routing_key: str, bodies: Iterable[bytes], window: int = 1000
    ) -> int:
        """Publish persistent JSON messages with publisher confirms, ``window`` in flight."""
        async with Producer(self.amqp_url) as producer:
            return await producer.publish(exchange_name, routing_key, bodies, window)

    async def _declared(self, queue: str) -> Any:
        """The broker's answer to a passive declare of ``queue`` (its depth and consumers)."""
        connection = await aio_pika.connect(self.amqp_url)
        try:
            channel = await connection.channel()
            declared = await channel.declare_queue(queue, passive=True)
            return declared.declaration_result
        finally:
            await connection.close()

    async def queue_depth(self, queue: str) -> int:
        return int((await self._declared(queue)).message_count or 0)

    async def consumer_count(self, queue: str) -> int:
        return int((await self._declared(queue)).consumer_count or 0)

    async def wait_for_depth(self, queue: str, count: int, limit_s: float = 120) -> None:
        deadline = time.monotonic() + limit_s
        while (depth := await self.queue_depth(queue)) < count:
            if time.monotonic() > deadline:
                raise BenchError(f"queue {queue} holds {depth} messages, expected {count}")
            await asyncio.sleep(0.2)

    async def _exists(self, kind: str, name: str) -> bool:
        connection = await aio_pika.connect(self.amqp_url)
        try:
            channel = await connection.channel()
            try:
                if kind == "exchange":
                    await channel.declare_exchange(name, passive=True)
                else:
                    await channel.declare_queue(name, passive=True)
            except aiormq.exceptions.ChannelNotFoundEntity:
                return False
            return True
        finally:
            await connection.close()

    async def delete_broker_objects(self, queues: Iterable[str], exchanges: Iterable[str]) -> None:
        connection = await aio_pika.connect(self.amqp_url)
        try:
            for kind, names in (("queue", queues), ("exchange", exchanges)):
                for name in names:
                    channel = await connection.channel()
                    try:
                        if kind == "queue":
                            await channel.queue_delete(name)
                        else:
                            await channel.exchange_delete(name)
                    except aiormq.exceptions.AMQPError:
                        pass  # already gone (the channel closed with it)
                    finally:
                        if not channel.is_closed:
                            await channel.close()
        finally:
            await connection.close()

    async def _rabbitmqctl_names(self, what: str) -> list[str]:
        process = await asyncio.create_subprocess_exec(
            "rabbitmqctl",
            what,
            "-q",
            "--no-table-headers",
            "name",
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
        )
        output, errors = await asyncio.wait_for(process.communicate(), 60)
        if process.returncode != 0:
            raise BenchError(f"rabbitmqctl {what} failed: {errors.decode(errors='replace')}")
        return [line.strip() for line in output.decode().splitlines() if line.strip()]

    async def sweep_broker(self, name: str | None = None) -> int:
        """Delete the queues and exchanges called ``name`` or ``name.*`` (default: everything
        of this invocation, ``bench_<id>_*``). Lists them with ``rabbitmqctl``, so nothing the
        service declared is missed, whatever its topology looks like."""

        def ours(candidate: str) -> bool:
            if name is None:
                return candidate.startswith(self.prefix + "_")
            return candidate == name or candidate.startswith(name + ".")

        queues = [n for n in await self._rabbitmqctl_names("list_queues") if ours(n)]
        exchanges = [n for n in await self._rabbitmqctl_names("list_exchanges") if ours(n)]
        await self.delete_broker_objects(queues, exchanges)
        return len(queues) + len(exchanges)

    async def note_celery_delayed_delivery(self) -> None:
        """Remember whether Celery's shared delayed-delivery topology existed before us."""
        if self.celery_delayed_existed is None:
            self.celery_delayed_existed = await self._exists("exchange", "celery_delayed_delivery")

    async def remove_celery_delayed_delivery(self) -> None:
        """Delete ``celery_delayed_*`` (28 quorum queues and their exchanges) if we made them."""
        if self.celery_delayed_existed is not False:
            return
        levels = [f"celery_delayed_{level}" for level in range(28)]
        await self.delete_broker_objects(levels, [*levels, "celery_delayed_delivery"])


class Producer:
    """One connection and confirm-mode channel for many publishes and queue-depth reads."""

    def __init__(self, url: str) -> None:
        self._url = url
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def __aenter__(self) -> Producer:
        self._connection = await aio_pika.connect(self._url)
        self._channel = await self._connection.channel(
            publisher_confirms=True, on_return_raises=True
        )
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    @property
    def channel(self) -> AbstractChannel:
        if self._channel is None:
            raise RuntimeError("the producer is not open")
        return self._channel

    async def publish(
        self, exchange_name: str, routing_key: str, bodies: Iterable[bytes], window: int = 1000
    ) -> int:
        channel = self.channel
        exchange = (
            channel.default_exchange
            if exchange_name == ""
            else await channel.get_exchange(exchange_name, ensure=False)
        )
        sent = 0
        batch: list[bytes] = []

        async def flush() -> None:
            await asyncio.gather(
                *(
                    exchange.publish(
                        aio_pika.Message(
                            body,
                            content_type="application/json",
                            delivery_mode=DeliveryMode.PERSISTENT,
                        ),
                        routing_key=routing_key,
                        timeout=60,
                    )
                    for body in batch
                )
            )

        for body in bodies:
            batch.append(body)
            if len(batch) >= window:
                await flush()
                sent += len(batch)
                batch = []
        await flush()
        return sent + len(batch)

    async def depth(self, queue: str) -> int:
        """Ready messages in ``queue`` (a passive declare)."""
        declared = await self.channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)


# -- child processes ----------------------------------------------------------------------------


@dataclass
class Child:
    """A process under measurement, its output going to a log file."""

    label: str
    process: subprocess.Popen[bytes]
    log_path: Path
    started: float

    @classmethod
    def spawn(cls, label: str, argv: list[str], env: Mapping[str, str], log_path: Path) -> Child:
        log: IO[bytes] = log_path.open("ab")
        try:
            process = subprocess.Popen(
                argv,
                env=dict(env),
                cwd=REPO,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # its own process group: stop it and its children
            )
        finally:
            log.close()
        return cls(label, process, log_path, time.time())

    @property
    def pid(self) -> int:
        return self.process.pid

    def exited(self) -> int | None:
        return self.process.poll()

    def peak_rss_mb(self) -> float:
        """Sum of the peak RSS (VmHWM) of the process and its descendants, alive now."""
        return procfs.rss_mb(procfs.process_tree(self.pid), "VmHWM")

    def rss_mb(self) -> float:
        return procfs.rss_mb(procfs.process_tree(self.pid), "VmRSS")

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-chars:]
        except OSError:
            return ""

    async def stop(self, grace: float = 40) -> int:
        """SIGTERM (a graceful stop for all three consumers), then SIGKILL to the group."""
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                await asyncio.to_thread(self.process.wait, grace)
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        return self.process.wait(timeout=10)


async def fetchval(dsn: str, query: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()
