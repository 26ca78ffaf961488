"""Helpers for integration tests: a test's own names and database, the service as a real process,
a fast confirmed producer, and reading queues, rows and metrics."""

from __future__ import annotations

import asyncio
import contextlib
import glob
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import urlsplit

import aio_pika
import aiohttp
import aiormq
import asyncpg
from aio_pika.abc import AbstractChannel, AbstractConnection, DeliveryMode
from prometheus_client.parser import text_string_to_metric_families

from consumer.cli.producer import envelope_body
from consumer.config.queue_table import read_queue_table
from consumer.config.settings import Settings
from consumer.envelope import Envelope, set_follow_ups
from consumer.handlers.inventory import Reserve
from consumer.outbox import Publishes
from consumer.registry import HandlerRegistry
from consumer.service.components import names_for, table_topology, topology_for
from topology.apply import apply_topology
from topology.model import Topology
from topology.names import Names

REPO = Path(__file__).resolve().parent.parent
TEST_HANDLERS = "consumer.handlers.inventory,consumer.handlers.notifications,tests.handlers.behave"
REFERENCE_HANDLERS = "consumer.handlers.inventory,consumer.handlers.notifications"
REFERENCE_TABLE = """
[queues.stock]
types = ["inventory.restock", "inventory.reserve"]
[queues.notify]
types = ["notification.requested"]
"""
"""A queue table (CONSUMER_QUEUES_FILE) of two queues for the reference handlers' types."""

IN_FLIGHT = "consumer_in_flight"
# Deliveries the service tried to settle a second time: 0 unless there is a bug. (A metric the
# service is gaining; until then it is absent, which reads as 0.)
SETTLED_TWICE = "consumer_settled_twice_total"
SETTLE_TIMEOUT = 15.0
UNACKED_TIMEOUT = 10.0


async def wait_until(
    predicate: Callable[[], Awaitable[bool]],
    *,
    timeout: float = 30,
    interval: float = 0.1,
    what: str = "condition",
) -> None:
    """Poll ``predicate`` until true; fail the test naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if await predicate():
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        await asyncio.sleep(interval)


class FakeDelivery:
    """A stand-in for a delivery in unit tests: any attributes, compared by identity and weakly
    referenced as a real :class:`~consumer.amqp.delivery.Delivery` is (what the service learns of
    a delivery is kept keyed by it)."""

    def __init__(self, **attributes: Any) -> None:
        self.__dict__.update(attributes)

    def __getattr__(self, name: str) -> Any:
        raise AttributeError(name)


@dataclass
class TestEnv:
    """One test's world: its own name prefix, database, HTTP port and settings."""

    __test__ = False

    name: str
    database_url: str
    amqp_url: str
    http_port: int
    log_dir: Path
    overrides: dict[str, str] = field(default_factory=dict)
    topologies: list[Topology] = field(default_factory=list)
    processes: list[ServiceProcess] = field(default_factory=list)

    def env(self, **overrides: str) -> dict[str, str]:
        """Environment for a service process; ``overrides`` are field names (``prefetch="5"``)."""
        values = {
            "CONSUMER_NAME": self.name,
            # An ingress exchange of the test's own: a service on the shared `events` (a local
            # `make run`) must never see test events, nor a test another test's.
            "CONSUMER_EXCHANGE": f"{self.name}.events",
            "CONSUMER_DATABASE_URL": self.database_url,
            "CONSUMER_AMQP_URL": self.amqp_url,
            "CONSUMER_HTTP_PORT": str(self.http_port),
            "CONSUMER_HANDLERS": TEST_HANDLERS,
            "CONSUMER_RETRY_DELAYS": "200ms,400ms,800ms",
            "CONSUMER_LOG_FORMAT": "json",
            "CONSUMER_SHUTDOWN_GRACE": "10s",
            "CONSUMER_RECONNECT_MAX_DELAY": "1s",
        }
        for key, value in {**self.overrides, **overrides}.items():
            values[f"CONSUMER_{key.upper()}"] = value
        base = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")}
        return {**base, **values, "PYTHONPATH": str(REPO)}

    def settings(self, **overrides: str) -> Settings:
        environment = self.env(**overrides)
        values = {
            key.removeprefix("CONSUMER_").lower(): value
            for key, value in environment.items()
            if key.startswith("CONSUMER_")
        }
        return Settings.model_validate(values)

    @property
    def names(self) -> Names:
        return names_for(self.settings())

    def topology(self, **overrides: str) -> Topology:
        settings = self.settings(**overrides)
        return topology_for(settings, HandlerRegistry.from_modules(settings.handlers))

    async def apply_topology(self, **overrides: str) -> Topology:
        topology = self.topology(**overrides)
        connection = await connect_any(self.amqp_url)
        try:
            await apply_topology(connection, topology)
        finally:
            await connection.close()
        self.topologies.append(topology)
        return topology

    def use_queue_table(self, text: str, folder: Path) -> Path:
        """Write the queue table ``text`` to ``folder`` and set ``CONSUMER_QUEUES_FILE`` to it for
        every process of the test; its topology is removed with the test's."""
        path = folder / "queues.toml"
        path.write_text(text)
        self.overrides["queues_file"] = str(path)
        self.topologies.append(table_topology(read_queue_table(path, self.settings())))
        return path

    async def bind_type(self, event_type: str) -> None:
        """Route ``event_type`` from the test's ingress exchange to its work queue, as a handler
        removed since the topology was applied leaves it bound: the one way a type no handler
        takes reaches the service under its own routing key (under another type's it is
        ``routing_key_mismatch``)."""
        connection = await connect_any(self.amqp_url)
        try:
            channel = await connection.channel()
            queue = await channel.get_queue(self.names.work, ensure=False)
            await queue.bind(self.settings().exchange, event_type)
        finally:
            await connection.close()

    def producer(self, url: str | None = None) -> Producer:
        """A producer for this test's ingress exchange, on ``url`` (else the test's broker)."""
        return Producer(url or self.amqp_url, self.settings().exchange)

    def kill_processes(self) -> None:
        """End every service process the test started and left running."""
        for service in self.processes:
            if service.running:
                service.kill()

    async def assert_settled(self, *, holds_deliveries: bool = False) -> None:
        """The settlement invariant at the end of a test, for each of its service processes
        still running (see :func:`assert_services_settled`), and nothing of the test's left
        unacked on the broker; then a clean stop of each (SIGTERM, exit 0)."""
        checked = await assert_services_settled(self.processes, holds_deliveries=holds_deliveries)
        if checked and not holds_deliveries:
            await assert_nothing_unacked(self.held_queues())
        await stop_cleanly(checked)

    async def assert_nothing_held(self) -> None:
        """After the test's services have stopped: no one holds a message of the test's."""
        await assert_nothing_unacked(self.held_queues())

    def held_queues(self) -> list[str]:
        """The test's work and delay queues, where an unsettled delivery shows as unacked, if
        they are on the shared node (which ``rabbitmqctl`` here reaches)."""
        url = urlsplit(self.amqp_url)
        if url.hostname not in ("127.0.0.1", "localhost") or (url.port or 5672) != 5672:
            return []
        dead = self.names.dead
        return sorted(
            {
                queue.name
                for topology in self.topologies
                for queue in topology.queues
                if queue.name != dead and queue.name.startswith(f"{self.name}.")
            }
        )

    async def cleanup_broker(self) -> None:
        """Delete the queues and exchanges of the test's topologies, its ingress exchange too,
        and never a name outside the test's own prefix (such as a shared ``events``)."""
        connection = await connect_any(self.amqp_url)
        try:
            channel = await connection.channel()
            for topology in self.topologies:
                for queue in topology.queues:
                    if queue.name.startswith(f"{self.name}."):
                        await channel.queue_delete(queue.name)
                for exchange in topology.exchanges:
                    if exchange.name.startswith(f"{self.name}."):
                        await channel.exchange_delete(exchange.name)
        finally:
            await connection.close()


LIBFAKETIME = sorted(glob.glob("/usr/lib/*/faketime/libfaketimeMT.so.1"))


def faked(environment: dict[str, str], offset_file: Path, offset: str) -> dict[str, str]:
    """``environment`` with this process's clock ``offset`` from the true time (``+10m``), read
    again from ``offset_file`` at every clock reading: a test may move it while the service runs.
    Only the wall clock moves: the event loop's timers run on the monotonic one."""
    assert LIBFAKETIME, "libfaketime is missing: install Debian's faketime (make tools)"
    offset_file.write_text(offset)
    return {
        **environment,
        "LD_PRELOAD": LIBFAKETIME[0],
        "FAKETIME_TIMESTAMP_FILE": str(offset_file),
        "FAKETIME_NO_CACHE": "1",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
    }


class ServiceProcess:
    """``python -m consumer run`` as a child process, with its JSON log captured to a file."""

    started: ClassVar[list[ServiceProcess]] = []
    """Every process started, in order: the fixtures check and end what a test left running."""

    def __init__(
        self,
        test_env: TestEnv,
        label: str = "service",
        *,
        launcher: Sequence[str] = (),
        run_args: Sequence[str] = (),
        **overrides: str,
    ) -> None:
        """``launcher``: argv put in front of the command (``ip netns exec <namespace>``: the
        network-fault lab's service host, whose HTTP address is ``CONSUMER_HTTP_HOST``);
        ``run_args``: after ``consumer run`` (``--queues a,b``)."""
        self.test_env = test_env
        self.label = label
        self.launcher = list(launcher)
        self.run_args = tuple(run_args)
        self.environment = test_env.env(**overrides)
        self.port = int(self.environment["CONSUMER_HTTP_PORT"])
        self.http_host = self.environment.get("CONSUMER_HTTP_HOST", "127.0.0.1")
        self.log_path = test_env.log_dir / f"{label}.log"
        self.process: subprocess.Popen[bytes] | None = None
        test_env.processes.append(self)

    def start(self) -> ServiceProcess:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [*self.launcher, sys.executable, "-m", "consumer", "run", *self.run_args],
            env=self.environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=REPO,
        )
        log.close()
        ServiceProcess.started.append(self)
        return self

    @property
    def running(self) -> bool:
        return self.process is not None and self.process.poll() is None

    @property
    def pid(self) -> int:
        assert self.process is not None
        return self.process.pid

    @property
    def returncode(self) -> int | None:
        assert self.process is not None
        return self.process.poll()

    async def readyz(self) -> tuple[int, dict[str, Any]]:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"http://{self.http_host}:{self.port}/readyz", timeout=aiohttp.ClientTimeout(3)
            ) as response,
        ):
            return response.status, await response.json()

    async def is_ready(self) -> bool:
        try:
            status, _ = await self.readyz()
        except (aiohttp.ClientError, TimeoutError):
            return False
        return status == 200

    async def wait_ready(self, timeout: float = 30) -> ServiceProcess:
        async def ready() -> bool:
            if self.returncode is not None:
                raise AssertionError(
                    f"service exited with {self.returncode} before ready:\n"
                    + self.log_text()[-3000:]
                )
            return await self.is_ready()

        await wait_until(ready, timeout=timeout, what="the service to be ready")
        return self

    async def metrics(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample of ``/metrics``, keyed by (name, sorted labels)."""
        async with (
            aiohttp.ClientSession() as session,
            session.get(f"http://{self.http_host}:{self.port}/metrics") as response,
        ):
            text = await response.text()
        samples: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
        return samples

    async def metric(self, name: str, **labels: str) -> float:
        return (await self.metrics()).get((name, tuple(sorted(labels.items()))), 0.0)

    async def metric_is(self, name: str, value: float, **labels: str) -> bool:
        """For polling: False (not an error) while ``/metrics`` does not answer."""
        try:
            return await self.metric(name, **labels) == value
        except (aiohttp.ClientError, OSError):
            return False

    async def metric_at_least(self, name: str, value: float, **labels: str) -> bool:
        """For polling: False (not an error) while ``/metrics`` does not answer."""
        try:
            return await self.metric(name, **labels) >= value
        except (aiohttp.ClientError, OSError):
            return False

    async def wait_idle(self, timeout: float = 30) -> None:
        """Until the service holds nothing and its work queue has nothing ready: everything
        published so far is settled (retry copies waiting out a rung aside)."""
        url = self.environment.get("CONSUMER_AMQP_URL", self.test_env.amqp_url)
        version = int(self.environment.get("CONSUMER_WORK_QUEUE_VERSION", "1"))
        work = Names(self.environment["CONSUMER_NAME"], "", version).work

        async def idle() -> bool:
            return await self.metric_is(IN_FLIGHT, 0) and await queue_depth(url, work) == 0

        await wait_until(idle, timeout=timeout, what=f"{self.label} to be idle")

    def signal(self, sig: signal.Signals) -> None:
        assert self.process is not None
        self.process.send_signal(sig)

    def kill(self) -> int:
        assert self.process is not None
        self.process.kill()
        return self.process.wait(timeout=10)

    async def wait_exit(self, timeout: float = 30) -> int:
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while self.process.poll() is None:
            if time.monotonic() > deadline:
                raise AssertionError(f"service did not exit within {timeout}s")
            await asyncio.sleep(0.05)
        return self.process.returncode

    async def stop(self, timeout: float = 30) -> int:
        if self.process is None or self.process.poll() is not None:
            return self.process.returncode if self.process else 0
        self.signal(signal.SIGTERM)
        try:
            return await self.wait_exit(timeout)
        except AssertionError:
            return self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        return self.log_text()[-chars:]

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for line in self.log_text().splitlines():
            try:
                decoded = json.loads(line)
            except ValueError:
                continue
            if isinstance(decoded, dict):
                lines.append(decoded)
        return lines


async def assert_services_settled(
    services: Iterable[ServiceProcess], *, holds_deliveries: bool = False
) -> list[ServiceProcess]:
    """The settlement invariant for each of ``services`` still running at the end of a test: it
    is ready (or is again within ``SETTLE_TIMEOUT``, after a reconnect), every delivery it
    received is settled within ``SETTLE_TIMEOUT`` (in flight back to 0), and none was settled
    twice. A test that ends with a service holding deliveries on purpose (paused, blocked) stops
    it itself or says ``holds_deliveries``: then only "none twice" is checked. Returns the
    services found ready and settled."""
    checked = []
    for service in services:
        if not service.running:
            continue
        if holds_deliveries:
            with contextlib.suppress(aiohttp.ClientError, OSError):
                twice = await service.metric(SETTLED_TWICE)
                assert twice == 0, f"{service.label}: {twice:g} deliveries settled a second time"
            continue
        try:
            await wait_until(service.is_ready, timeout=SETTLE_TIMEOUT, what="ready")
        except AssertionError:
            if service.returncode is not None:
                continue  # it ended on its own meanwhile: nothing of it left to settle
            raise AssertionError(
                f"{service.label} is still running at the end of the test but not ready: stop "
                "it in the test, or mark the test holds_deliveries(reason)"
            ) from None
        checked.append(service)

        async def settled(service: ServiceProcess = service) -> bool:
            return await service.metric_is(IN_FLIGHT, 0)

        try:
            await wait_until(settled, timeout=SETTLE_TIMEOUT, what="in flight to reach 0")
        except AssertionError:
            left = await service.metric(IN_FLIGHT)
            raise AssertionError(
                f"{service.label}: {left:g} deliveries received and never settled "
                f"({IN_FLIGHT} still {left:g} after {SETTLE_TIMEOUT:g}s)"
            ) from None
        twice = await service.metric(SETTLED_TWICE)
        assert twice == 0, f"{service.label}: {twice:g} deliveries settled a second time"
    return checked


async def stop_cleanly(services: Iterable[ServiceProcess]) -> None:
    """SIGTERM each of ``services`` (settled and idle): each exits 0."""
    for service in services:
        code = await service.stop()
        assert code == 0, f"{service.label} exited with {code} on SIGTERM:\n{service.log_tail()}"


async def assert_nothing_unacked(queues: Collection[str], timeout: float = UNACKED_TIMEOUT) -> None:
    """None of ``queues`` (on the shared node) has an unacked message. Quorum queues'
    statistics lag a few seconds behind, so this polls up to ``timeout`` before failing."""
    if not queues:
        return
    unacked: dict[str, int] = {}

    async def none_unacked() -> bool:
        nonlocal unacked
        unacked = {q: n for q, n in (await unacked_messages(queues)).items() if n}
        return not unacked

    try:
        await wait_until(none_unacked, timeout=timeout, interval=1, what="no unacked messages")
    except AssertionError:
        raise AssertionError(f"unacked messages left in the test's queues: {unacked}") from None


async def rabbitmqctl(*args: str, input_text: str | None = None) -> str:
    """``rabbitmqctl`` on the shared node (the tests run as root, which may); its stdout."""
    result = await asyncio.to_thread(
        subprocess.run,
        ["rabbitmqctl", *args],
        capture_output=True,
        text=True,
        input=input_text,
        timeout=60,
        check=False,
    )
    assert result.returncode == 0, f"rabbitmqctl {args[0]}: {result.stderr.strip()}"
    return result.stdout


async def unacked_messages(queues: Collection[str]) -> dict[str, int]:
    """``messages_unacknowledged`` of each of ``queues`` that exists on the shared node."""
    listed = json.loads(
        await rabbitmqctl("list_queues", "name", "messages_unacknowledged", "--formatter", "json")
    )
    return {
        row["name"]: int(row.get("messages_unacknowledged") or 0)
        for row in listed
        if row["name"] in queues
    }


_OCCURRED: dict[uuid.UUID, datetime] = {}
"""Each event's occurred_at, as its producer keeps its envelope: an event sent again (a producer's
retry, by any :class:`Producer` of the test run) is the same envelope. The receipts tell copies
apart by (event_id, occurred_at): a copy with a new occurred_at would be another event."""


class Producer:
    """Publishes persistent events with publisher confirms, many at a time."""

    def __init__(self, url: str, exchange: str) -> None:
        self._url = url
        self._exchange_name = exchange
        self._connection: AbstractConnection | None = None
        self._channel: AbstractChannel | None = None

    async def __aenter__(self) -> Producer:
        self._connection = await aio_pika.connect(self._url)
        self._channel = await self._connection.channel(publisher_confirms=True)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self._connection is not None:
            await self._connection.close()

    async def send_raw(
        self,
        body: bytes,
        routing_key: str,
        *,
        content_type: str | None = "application/json",
        content_encoding: str | None = None,
        headers: dict[str, Any] | None = None,
        exchange: str | None = None,
    ) -> None:
        assert self._channel is not None
        target = await self._channel.get_exchange(exchange or self._exchange_name, ensure=False)
        await target.publish(
            aio_pika.Message(
                body,
                content_type=content_type,
                content_encoding=content_encoding,
                delivery_mode=DeliveryMode.PERSISTENT,
                headers=headers,
                message_id=str(uuid.uuid4()),
            ),
            routing_key,
            timeout=30,
        )

    async def send(
        self,
        event_type: str,
        payload: dict[str, Any],
        *,
        event_id: uuid.UUID | None = None,
        occurred_at: datetime | None = None,
    ) -> uuid.UUID:
        event_id = event_id or uuid.uuid4()
        if occurred_at is not None:
            _OCCURRED[event_id] = occurred_at
        occurred_at = _OCCURRED.setdefault(event_id, datetime.now(UTC))
        body = envelope_body(event_type, payload, event_id=event_id, occurred_at=occurred_at)
        await self.send_raw(body, event_type)
        return event_id

    async def send_many(
        self, events: Iterable[tuple[str, dict[str, Any], uuid.UUID]], chunk: int = 500
    ) -> int:
        """Publish ``(type, payload, event_id)`` triples, ``chunk`` confirms in flight at a time."""
        pending: list[Awaitable[Any]] = []
        sent = 0
        for event_type, payload, event_id in events:
            pending.append(self.send(event_type, payload, event_id=event_id))
            if len(pending) >= chunk:
                await asyncio.gather(*pending)
                sent += len(pending)
                pending = []
        await asyncio.gather(*pending)
        return sent + len(pending)


async def connect_any(urls: str, timeout: float = 10) -> AbstractConnection:
    """A connection to the first node of ``urls`` (comma-separated, as ``CONSUMER_AMQP_URL``
    takes a cluster's) that answers."""
    *others, last = urls.split(",")
    for url in others:
        with contextlib.suppress(OSError, aiormq.exceptions.AMQPError, TimeoutError):
            return await aio_pika.connect(url, timeout=timeout)
    return await aio_pika.connect(last, timeout=timeout)


async def _declared(url: str, queue: str) -> aiormq.spec.Queue.DeclareOk:
    """What a passive declare of ``queue`` answers; ``url`` may list a cluster's nodes."""
    connection = await connect_any(url)
    try:
        channel = await connection.channel()
        declared = await channel.declare_queue(queue, passive=True)
        return declared.declaration_result
    finally:
        await connection.close()


async def queue_depth(url: str, queue: str) -> int:
    """Ready messages in ``queue`` (passive declare; unacked ones are not counted); ``url`` may
    list a cluster's nodes."""
    return int((await _declared(url, queue)).message_count or 0)


async def queue_consumers(url: str, queue: str) -> int:
    """How many consumers the broker counts on ``queue`` (passive declare)."""
    return int((await _declared(url, queue)).consumer_count or 0)


async def drain_queue(
    url: str, queue: str, *, ack: bool = True
) -> list[aio_pika.abc.AbstractIncomingMessage]:
    """Every message now in ``queue``; acked (removed) unless ``ack`` is False (then returned)."""
    connection = await aio_pika.connect(url)
    messages = []
    try:
        channel = await connection.channel()
        target = await channel.get_queue(queue)
        while (message := await target.get(no_ack=False, fail=False)) is not None:
            messages.append(message)
        for message in messages:
            if ack:
                await message.ack()
            else:
                await message.nack(requeue=True)
    finally:
        await connection.close()
    return messages


def queue_of(env: TestEnv, queue: str | None, part: str = "work") -> str:
    """The name of ``part`` (``work``, ``dead``, ``retry.1s``...) of queue ``queue`` of the test's
    queue table; with ``None``, of the one queue the service has without a table."""
    return f"{env.name}.{part}" if queue is None else f"{env.name}.{queue}.{part}"


async def depth_is(env: TestEnv, queue: str | None, depth: int) -> bool:
    """For polling: the work queue of ``queue`` (:func:`queue_of`) holds ``depth`` messages."""
    return await queue_depth(env.amqp_url, queue_of(env, queue)) == depth


async def queue_exists(url: str, queue: str) -> bool:
    connection = await aio_pika.connect(url)
    try:
        channel = await connection.channel()
        try:
            await channel.declare_queue(queue, passive=True)
        except aiormq.exceptions.ChannelNotFoundEntity:
            return False
        return True
    finally:
        await connection.close()


async def fetchval(dsn: str, query: str, *args: Any) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query, *args)
    finally:
        await conn.close()


async def fetch(dsn: str, query: str, *args: Any) -> list[asyncpg.Record]:
    conn = await asyncpg.connect(dsn)
    try:
        return list(await conn.fetch(query, *args))
    finally:
        await conn.close()


async def count_rows(env: TestEnv, table: str) -> int:
    """The rows of ``table`` (a name the test gives, never input) in the test's database."""
    return int(await fetchval(env.database_url, f"SELECT count(*) FROM {table}"))


async def effect_counts(dsn: str, table: str = "test_effects") -> dict[uuid.UUID, int]:
    """Rows per event in an effect table (none of which has a unique key in the tests)."""
    rows = await fetch(dsn, f"SELECT event_id, count(*) AS n FROM {table} GROUP BY event_id")
    return {row["event_id"]: int(row["n"]) for row in rows}


async def assert_applied_once(
    dsn: str, expected: Collection[uuid.UUID], table: str = "test_effects"
) -> None:
    """Exactly once, counted: every event with a row in ``table`` has exactly one, and the events
    with one are exactly ``expected``."""
    counts = await effect_counts(dsn, table)
    doubled = {str(event_id): n for event_id, n in counts.items() if n != 1}
    assert not doubled, f"applied more than once in {table}: {doubled}"
    wanted = set(expected)
    missing = sorted(map(str, wanted - counts.keys()))
    extra = sorted(map(str, counts.keys() - wanted))
    assert not missing, f"{len(missing)} events never applied in {table}: {missing[:5]}"
    assert not extra, f"{len(extra)} events applied in {table} unexpectedly: {extra[:5]}"


async def restarted_while_it_dies(
    env: TestEnv, service: ServiceProcess, *, most: int, exit_code: int = 17
) -> tuple[int, ServiceProcess]:
    """Start the service again each time it dies (exit ``exit_code``), as systemd or Kubernetes
    would, until one stays up (20s); the deaths (at most ``most``) and the one that stayed up."""
    deaths = 0
    while True:
        try:
            code = await service.wait_exit(timeout=20)
        except AssertionError:
            return deaths, service  # it stayed up
        assert code == exit_code
        deaths += 1
        assert deaths <= most, "crash attribution should have named the culprit"
        await asyncio.sleep(0.2)
        service = ServiceProcess(env, f"run-{deaths}").start()


def run_cli(
    module: str, *args: str, env: dict[str, str], input_text: str | None = None, timeout: float = 60
) -> subprocess.CompletedProcess[str]:
    """``python -m <module> args`` with ``env``; output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", module, *args],
        env=env,
        cwd=REPO,
        capture_output=True,
        text=True,
        input=input_text,
        timeout=timeout,
        check=False,
    )


def behave(key: str, **spec: Any) -> dict[str, Any]:
    """A ``test.behave`` payload."""
    return {"key": key, **spec}


Event = tuple[str, dict[str, object], uuid.UUID]


def restocks(count: int) -> list[Event]:
    """``count`` restocks of one SKU, a unit each: each one's effect is a stock movement."""
    return [("inventory.restock", {"sku": "SKU", "qty": 1}, uuid.uuid4()) for _ in range(count)]


def reservation_in_a_call(
    payload: dict[str, Any], handlers: HandlerRegistry
) -> tuple[Envelope[Reserve], Publishes]:
    """An ``inventory.reserve`` event as a handler call the service makes gets it, for calling
    the handler directly: its ``publish`` adds to the collection returned with it (consumer
    ``svc``, the publishes checked against ``handlers``)."""
    event = Envelope[Reserve](
        event_id=uuid.uuid4(),
        type="inventory.reserve",
        occurred_at=datetime.now(UTC),
        payload=Reserve.model_validate(payload),
    )
    publishes = Publishes(event, consumer="svc", handlers=handlers)
    set_follow_ups(event, publishes)
    return event, publishes


async def movements(dsn: str) -> int:
    return int(await fetchval(dsn, "SELECT count(*) FROM stock_movements"))


async def assert_exactly_once(dsn: str, events: list[Event]) -> None:
    """Each of :func:`restocks`' events applied exactly once: a movement, a receipt, a unit."""
    await assert_applied_once(dsn, [event_id for _, _, event_id in events], "stock_movements")
    assert await fetchval(dsn, "SELECT count(*) FROM receipts") == len(events)
    assert await fetchval(dsn, "SELECT available FROM stock WHERE sku = 'SKU'") == len(events)


async def movements_at_least(dsn: str, expected: int) -> bool:
    """For polling: at least ``expected`` stock movements; False while the database is down."""
    try:
        return await movements(dsn) >= expected
    except OSError:
        return False
