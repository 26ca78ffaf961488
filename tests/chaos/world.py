"""One scenario's world: its names, database and consumer processes on the run's throwaway servers.

Consumers are ``python -m consumer run`` processes (:class:`tests.support.ServiceProcess`). Each
start of one is a :class:`Lifetime`; the metrics of a lifetime die with it, so the checks compare
them with the database only where that is exact (see :meth:`World.metrics_check`).

A consumer that exits without being told to is started again, as a supervisor would
(:meth:`World.revive_crashed`, and :meth:`World.supervise` all along where a scenario expects such
exits). Starting, stopping and reviving one consumer take its lock, so a fault's SIGKILL and the
supervisor never both act on the same exit.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from tests.chaos import relay_kill, shards, table
from tests.chaos.netsite import NetSite
from tests.servers import (
    PostgresServer,
    ThrowawayPostgres,
    ThrowawayPostgresPair,
    ThrowawayRabbit,
    ThrowawayRabbitCluster,
    free_port,
)
from tests.support import ServiceProcess, TestEnv, faked

SCRAPE_TIMEOUT = 3.0
READY_TIMEOUT = 60.0
STOP_TIMEOUT = 40.0
"""SIGTERM to exit: the test environment's shutdown grace (10s) and then some."""

_APPLIED = (
    "SELECT (SELECT count(*) FROM test_effects) + (SELECT count(*) FROM stock_movements)"
    " + (SELECT count(*) FROM notifications)"
)
SUPERVISE_EVERY = 0.25
"""How often :meth:`World.supervise` looks for consumers that exited by themselves."""


@dataclass
class Lifetime:
    """One run of one consumer process, from start to SIGKILL, SIGTERM or the scenario's end."""

    consumer: int
    epoch: int | None
    """Set when it started with no other consumer running, so nothing else applied meanwhile."""
    scraped: dict[str, float] = field(default_factory=dict)
    """The last ``/metrics`` figures seen (see :func:`summarise_metrics`)."""
    end: str | None = None
    exit_code: int | None = None


@dataclass
class Partition:
    """One cut of the lab's links: between which hosts, and when (wall clock, UTC)."""

    label: str
    cut_at: datetime
    healed_at: datetime | None = None
    server_log_from: int = 0
    """Where the lab PostgreSQL's log stood at the cut: what it says after is the cut's."""


@dataclass
class Epoch:
    """Consumers started together while none ran: the effects already applied then, exactly."""

    applied_before: int
    lifetimes: list[Lifetime] = field(default_factory=list)


def summarise_metrics(
    samples: dict[tuple[str, tuple[tuple[str, str], ...]], float],
) -> dict[str, float]:
    """``processed``, ``duplicate``, ``poison``... (messages by outcome, summed over types),
    ``dead:<reason>`` (dead letters by reason) and ``redelivered`` (deliveries the broker flagged
    as redelivered) from one scrape."""
    summary: dict[str, float] = {}
    for (name, labels), value in samples.items():
        label = dict(labels)
        if name == "consumer_messages_total":
            key = label.get("outcome", "?")
        elif name == "consumer_dead_letters_total":
            key = "dead:" + label.get("reason", "?")
        elif name == "consumer_redeliveries_total":
            key = "redelivered"
        elif name == "consumer_outbox_published_total":
            key = "outbox_published"
        else:
            continue
        summary[key] = summary.get(key, 0.0) + value
    return summary


def rotated(urls: list[str], start: int) -> str:
    """The node list as ``CONSUMER_AMQP_URL`` takes it, starting at node ``start`` (mod the
    count): consumers given different starts connect to different nodes."""
    start %= len(urls)
    return ",".join(urls[start:] + urls[:start])


class Progress:
    """Polls how many effects are applied, on its own connection, through outages and freezes."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self.applied = 0
        self._changed = asyncio.Event()

    async def run(self) -> None:
        while True:
            conn: asyncpg.Connection[Any] | None = None
            try:
                conn = await asyncpg.connect(self._dsn, timeout=2)
                while True:
                    value = int(await conn.fetchval(_APPLIED, timeout=2))
                    if value != self.applied:
                        self.applied = value
                        self._changed.set()
                    await asyncio.sleep(0.2)
            except Exception:
                # Any failure of the connection (a restart can leave asyncpg's protocol in a
                # state it reports as InternalClientError, no PostgresError nor
                # InterfaceError): connect again. A count that stops moving would hold every
                # fault's gate and end the settling early.
                await asyncio.sleep(0.5)
            finally:
                if conn is not None:
                    conn.terminate()

    async def reach(self, target: int, deadline: float) -> bool:
        """Wait until ``applied >= target``; False if ``deadline`` (monotonic) passes first."""
        while self.applied < target:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), timeout=min(remaining, 1.0))
        return True


class World:
    """The servers, names, database and consumers of one scenario."""

    def __init__(
        self,
        *,
        env: TestEnv,
        rabbit: ThrowawayRabbit,
        postgres: ThrowawayPostgres,
        consumers: int,
        self_exits: frozenset[int] = frozenset(),
        cluster: ThrowawayRabbitCluster | None = None,
        pair: ThrowawayPostgresPair | None = None,
        net: NetSite | None = None,
        service_amqp_url: str | None = None,
        clock_file: Path | None = None,
        service_database_url: str | None = None,
        proxy_control: Path | None = None,
        first_node: int = 1,
        wraps_relay: bool = False,
        queues_of: Sequence[str] = (),
    ) -> None:
        self.env = env
        self.wraps_relay = wraps_relay
        """The consumers run under :mod:`tests.chaos.relay_kill`: a fault can arm each one's
        relay to SIGKILL its process between a confirm and the mark (:meth:`relay_files`)."""
        self.queues_of = tuple(queues_of)
        """Consumer ``n``'s ``consumer run --queues`` (a process per class of work), where the
        queue table is split over processes; empty: every consumer runs every queue."""
        self.first_node = first_node
        """On a cluster: consumer ``n``'s node list starts at node ``n + first_node``."""
        self.rabbit = rabbit
        self.postgres = postgres
        self.cluster = cluster
        """Where the scenario runs on a cluster: its nodes (``env.amqp_url`` lists them)."""
        self.pair = pair
        """Where the scenario fails PostgreSQL over: the pair (``env.database_url`` names both)."""
        self.database: PostgresServer = pair or postgres
        self.net = net
        """Where the scenario runs in the network-fault lab: its hosts, links and servers."""
        self.partitions: list[Partition] = []
        """The lab's cuts, when each began and healed (for the time to detect and resume)."""
        self.service_database_url = service_database_url
        """Where the consumers reach PostgreSQL, if not where the runner does (the proxy)."""
        self.proxy_control = proxy_control
        """Where the consumers go through the latency proxy: the file that sets its delay."""
        self.clock_file = clock_file
        """Where the consumers run under libfaketime: the offset file they read at every clock
        reading (a fault moves it)."""
        self.background: list[asyncio.Task[None]] = []
        """A fault's own tasks that outlive its injection (the end of a degraded stretch): the
        runner awaits them before it settles, and cancels any left at the end."""
        self.violations: list[str] = []
        """What a fault found broken (a skew the consumers did not report)."""
        self.services = [self._service(index, service_amqp_url) for index in range(consumers)]
        self.current: list[Lifetime | None] = [None] * consumers
        self._locks = [asyncio.Lock() for _ in range(consumers)]
        self.lifetimes: list[Lifetime] = []
        self.epochs: list[Epoch] = []
        self.progress = Progress(env.database_url)
        self.notes: list[str] = []
        """Things that went wrong on the way (a consumer not ready in time, an unplanned exit)."""
        self.unexpected_exits: list[str] = []
        self.allowed_exit_codes = self_exits
        """Exit codes with which a consumer may exit by itself here (restarted, reported)."""
        self.self_exits: Counter[str] = Counter()
        """Exits by themselves with an allowed code, by consumer and code: each one restarted."""
        self.restarted: Counter[int] = Counter()
        """Restarts after an exit by itself (allowed or not), by consumer index."""
        self.strike: shards.Strike | None = None
        """Where a fault struck a sharded queue's shard leader: the node, when, the leaders."""

    def _service(self, index: int, amqp_url: str | None) -> ServiceProcess:
        overrides: dict[str, str] = {"http_port": str(free_port())}
        if self.cluster is not None:
            overrides["amqp_url"] = rotated(self.cluster.urls, index + self.first_node)
        if amqp_url is not None:
            overrides["amqp_url"] = amqp_url
        if self.service_database_url is not None:
            overrides["database_url"] = self.service_database_url
        run_args = ("--queues", self.queues_of[index]) if self.queues_of else ()
        if self.net is None:
            launcher = relay_kill.launcher() if self.wraps_relay else []
            service = ServiceProcess(
                self.env, f"consumer-{index}", launcher=launcher, run_args=run_args, **overrides
            )
            if self.wraps_relay:
                arm, record = self.relay_files(index)
                service.environment[relay_kill.ARM] = str(arm)
                service.environment[relay_kill.RECORD] = str(record)
            if self.clock_file is not None:
                service.environment = faked(service.environment, self.clock_file, "+0s")
            return service
        # On the lab's service host, its HTTP endpoint on the host's address for the runner.
        overrides["http_host"] = self.net.address("service")
        return ServiceProcess(
            self.env, f"consumer-{index}", launcher=self.net.launcher("service"), **overrides
        )

    def relay_files(self, index: int) -> tuple[Path, Path]:
        """Consumer ``index``'s relay kill files: the one that arms its next kill, and the
        record of the rows each kill left confirmed and unmarked (:mod:`.relay_kill`)."""
        folder = self.env.log_dir
        return folder / f"relay-arm-{index}", folder / f"relay-killed-{index}.jsonl"

    # -- consumers --------------------------------------------------------------------------

    def alive(self, index: int) -> bool:
        service = self.services[index]
        return service.process is not None and service.process.poll() is None

    def hosts(self, queue: str) -> list[int]:
        """The consumers that run queue ``queue`` of the table."""
        if not self.queues_of:
            return list(range(len(self.services)))
        return [i for i, names in enumerate(self.queues_of) if queue in names.split(",")]

    def pids(self) -> list[int]:
        """The running consumers' process ids."""
        return [s.pid for index, s in enumerate(self.services) if self.alive(index)]

    def any_alive(self) -> bool:
        return any(self.alive(index) for index in range(len(self.services)))

    async def start(self, *indices: int) -> None:
        """Start these consumers and wait until each is ready."""
        async with contextlib.AsyncExitStack() as held:
            for index in sorted(indices):
                await held.enter_async_context(self._locks[index])
            await self._start(*indices)

    async def _start(self, *indices: int) -> None:
        epoch: int | None = None
        if not self.any_alive():
            await self._quiesce()
            self.epochs.append(Epoch(applied_before=await self.count_applied()))
            epoch = len(self.epochs) - 1
        for index in indices:
            lifetime = Lifetime(index, epoch)
            if epoch is not None:
                self.epochs[epoch].lifetimes.append(lifetime)
            self.lifetimes.append(lifetime)
            self.current[index] = lifetime
            self.services[index].start()
        await self.wait_ready(*indices)

    async def wait_ready(self, *indices: int) -> None:
        """Wait until these consumers (all running ones if none named) answer ``/readyz``."""
        chosen = indices or tuple(i for i in range(len(self.services)) if self.alive(i))
        results = await asyncio.gather(
            *(self.services[i].wait_ready(timeout=READY_TIMEOUT) for i in chosen),
            return_exceptions=True,
        )
        for index, result in zip(chosen, results, strict=True):
            process = self.services[index].process
            if process is not None and process.poll() in self.allowed_exit_codes:
                continue  # exited by itself as this scenario expects: revived and counted
            if isinstance(result, BaseException):
                self.notes.append(f"consumer-{index} not ready: {str(result).splitlines()[0]}")

    async def scrape(self, index: int) -> None:
        lifetime = self.current[index]
        if lifetime is None or not self.alive(index):
            return
        try:
            samples = await asyncio.wait_for(self.services[index].metrics(), SCRAPE_TIMEOUT)
        except Exception:  # a consumer busy or reconnecting: keep the last scrape
            return
        lifetime.scraped = summarise_metrics(samples)

    def _ended(self, index: int, how: str, exit_code: int | None) -> None:
        lifetime = self.current[index]
        if lifetime is not None:
            lifetime.end, lifetime.exit_code = how, exit_code
        self.current[index] = None

    async def kill(self, index: int) -> None:
        async with self._locks[index]:
            await self.scrape(index)
            code = await asyncio.to_thread(self.services[index].kill)
            self._ended(index, "SIGKILL", code)

    async def terminate(self, index: int, how: str = "SIGTERM") -> int:
        """Scrape, SIGTERM and wait for the exit; the code (0 is a clean drain)."""
        async with self._locks[index]:
            await self.scrape(index)
            code = await self.services[index].stop(timeout=STOP_TIMEOUT)
            self._ended(index, how, code)
        if code != 0:
            self.unexpected_exits.append(f"consumer-{index} exited with {code} after SIGTERM")
        return code

    async def stop_all(self) -> None:
        """The scenario's end: a last scrape of each running consumer, then SIGTERM to all (one
        that has just exited by itself is recorded, not started again)."""
        for index, service in enumerate(self.services):
            process = service.process
            if self.current[index] is None or process is None or process.poll() is None:
                continue
            code = process.poll()
            what = f"consumer-{index} exited by itself with {code}"
            if code in self.allowed_exit_codes:
                self.notes.append(f"{what} at the end (not restarted)")
            else:
                self.unexpected_exits.append(what)
            self._ended(index, "exited", code)
        running = [index for index in range(len(self.services)) if self.alive(index)]
        await asyncio.gather(*(self.terminate(index, "final") for index in running))

    async def revive_crashed(self) -> None:
        """Restart, as a supervisor would, a consumer that exited without being told to. With an
        allowed code (see ``self_exits``) that is counted; otherwise it is a violation."""
        for index in range(len(self.services)):
            async with self._locks[index]:
                service = self.services[index]
                if self.current[index] is None or self.alive(index) or service.process is None:
                    continue
                code = service.process.poll()
                if code in self.allowed_exit_codes:
                    self.self_exits[f"consumer-{index} exited by itself with {code}"] += 1
                else:
                    self.unexpected_exits.append(f"consumer-{index} exited by itself with {code}")
                self._ended(index, "exited", code)
                self.restarted[index] += 1
                await self._start(index)

    async def supervise(self) -> None:
        """Revive consumers that exit by themselves, all along (until cancelled)."""
        while True:
            await self.revive_crashed()
            await asyncio.sleep(SUPERVISE_EVERY)

    @property
    def restarts(self) -> int:
        """Consumers that exited by themselves (with an allowed code) and were started again."""
        return sum(self.self_exits.values())

    async def in_flight(self) -> int:
        """Deliveries the running consumers hold (their ``consumer_in_flight``, every queue's of
        a queue table); a consumer that does not answer counts as holding one."""
        held = 0
        for index, service in enumerate(self.services):
            if not self.alive(index):
                continue
            try:
                samples = await asyncio.wait_for(service.metrics(), SCRAPE_TIMEOUT)
                held += int(
                    sum(
                        value
                        for (name, _), value in samples.items()
                        if name == "consumer_in_flight"
                    )
                )
            except Exception:
                held += 1
        return held

    def pauses(self) -> list[str]:
        """The consumers' log lines that say they paused (``pausing``), as written."""
        return [
            line
            for service in self.services
            for line in service.log_text().splitlines()
            if "pausing" in line.lower()
        ]

    def broker_losses(self) -> Counter[str]:
        """The consumers' ``lost RabbitMQ`` log lines, by error (numbers made ``N``)."""
        lost: Counter[str] = Counter()
        for service in self.services:
            for line in service.log_lines():
                if line.get("event") == "lost RabbitMQ":
                    lost[re.sub(r"\d+", "N", str(line.get("error")))] += 1
        return lost

    def relay_published(self) -> dict[int, float]:
        """Outbox rows each consumer's relay published, by the last scrape of every process
        (a killed one's rows since that scrape are not counted)."""
        published: dict[int, float] = {}
        for lifetime in self.lifetimes:
            count = lifetime.scraped.get("outbox_published", 0.0)
            published[lifetime.consumer] = published.get(lifetime.consumer, 0.0) + count
        return published

    def relay_kill_records(self) -> list[int]:
        """The outbox row ids every relay kill left published, confirmed and unmarked."""
        return [
            row
            for index in range(len(self.services))
            for kill in relay_kill.kills_recorded(self.relay_files(index)[1])
            for row in kill
        ]

    def redeliveries(self) -> int:
        """Deliveries the broker flagged as redelivered, by the last scrape of every process."""
        return round(sum(lifetime.scraped.get("redelivered", 0.0) for lifetime in self.lifetimes))

    def log_findings(self) -> list[str]:
        """What the consumers' logs say about lost broker links (diagnostics, not invariants)."""
        lost = self.broker_losses()
        findings = [
            f"consumer logs: lost RabbitMQ {count}x: {error}" for error, count in lost.items()
        ]
        if pauses := self.pauses():
            findings.append(f"consumer logs: {len(pauses)} lines say pausing")
        findings += [f"{what} (restarted) x{count}" for what, count in self.self_exits.items()]
        return findings

    # -- the cluster and the PostgreSQL pair --------------------------------------------------

    def need_cluster(self) -> ThrowawayRabbitCluster:
        if self.cluster is None:
            raise RuntimeError("this fault needs a scenario on the RabbitMQ cluster")
        return self.cluster

    def need_net(self) -> NetSite:
        if self.net is None:
            raise RuntimeError("this fault needs a scenario in the network-fault lab")
        return self.net

    def need_pair(self) -> ThrowawayPostgresPair:
        if self.pair is None:
            raise RuntimeError("this fault needs a scenario on a PostgreSQL primary and standby")
        return self.pair

    async def node_of(self, target: str) -> int:
        """The index of the node leading the work queue (``leader``), the one consumer-0 is
        connected to (``connected``: by the port of its connection, named with its pid), or the
        one a sharded queue's fault strikes (``shard-leader``: :func:`.shards.pick_shard_leader`,
        recorded in :attr:`strike`)."""
        cluster = self.need_cluster()
        if target == "leader":
            return await asyncio.to_thread(cluster.leader_of, self.env.names.work)
        if target == "shard-leader":
            connected = await self.node_of("connected")
            led = await asyncio.to_thread(cluster.leaders_of, table.broker_queues(self.env).shards)
            struck = shards.pick_shard_leader(led, connected)
            self.strike = shards.Strike(struck, connected, datetime.now(UTC), led)
            self.background.append(
                asyncio.create_task(shards.watch_elections(cluster, self.strike), name="elections")
            )
            return struck
        ports = await asyncio.to_thread(cluster.connection_ports, f":{self.services[0].pid}")
        for index, node in enumerate(cluster.nodes):
            if node.port in ports:
                return index
        raise RuntimeError("consumer-0 has no connection to any node")

    def kill_everything(self) -> None:
        for index, service in enumerate(self.services):
            if self.alive(index):
                service.kill()

    # -- database -----------------------------------------------------------------------------

    async def count_applied(self) -> int:
        conn = await asyncpg.connect(self.env.database_url, timeout=10)
        try:
            return int(await conn.fetchval(_APPLIED, timeout=10))
        finally:
            await conn.close()

    async def _quiesce(self, timeout: float = 15) -> None:
        """Wait until no connection of this scenario's consumers is left in the database (a killed
        process's last COMMIT may still be in a backend), so a count is final."""
        deadline = time.monotonic() + timeout
        conn = await asyncpg.connect(self.database.admin_dsn, timeout=10)
        try:
            while time.monotonic() < deadline:
                left = await conn.fetchval(
                    "SELECT count(*) FROM pg_stat_activity WHERE application_name = $1",
                    self.env.name,
                )
                if left == 0:
                    return
                await asyncio.sleep(0.1)
        finally:
            await conn.close()
        self.notes.append("consumer connections still in the database at a restart")

    # -- what the consumers' own counters say --------------------------------------------------

    def metrics_check(
        self,
        applied: int,
        dead_by_reason: dict[str, int],
        broker_faults: bool,
        lost_commit_replies: bool = False,
    ) -> tuple[str, list[str]]:
        """Compare the consumers' ``/metrics`` with the database; (what was compared, failures).

        ``processed`` counts fresh commits (an effect each), per process: a killed process takes
        its count along, so only the last scrape before the kill is known, a lower bound.

        - Always: processed of the running consumers + last scrapes of ended ones <= effects.
        - When the consumers running at the end all started together while none ran, and none of
          them ended: their processed == effects applied since that start (exact).
        - When that start was the scenario's first and nothing cut the broker links: dead letters
          by reason (``consumer_dead_letters_total``) == the copies in ``<name>.dead``.

        ``lost_commit_replies``: PostgreSQL's answers to a COMMIT may have been lost. The service
        cannot tell that commit from another's: its re-run finds the receipt and counts a
        ``duplicate``, so processed may fall short of the effects by those commits (noted).
        """
        failures: list[str] = []
        final = [lifetime for lifetime in self.lifetimes if lifetime.end == "final"]
        ended = [lifetime for lifetime in self.lifetimes if lifetime.end != "final"]
        processed = sum(lifetime.scraped.get("processed", 0.0) for lifetime in final)
        before = sum(lifetime.scraped.get("processed", 0.0) for lifetime in ended)
        parts = []
        if processed + before > applied:
            failures.append(
                f"metrics: processed {processed:.0f} (+{before:.0f} scraped before kills or "
                f"stops) > {applied} effects"
            )
        epochs = {lifetime.epoch for lifetime in final}
        exact: Epoch | None = None
        if len(epochs) == 1 and (only := epochs.pop()) is not None:
            candidate = self.epochs[only]
            if all(lifetime.end == "final" for lifetime in candidate.lifetimes):
                exact = candidate
        if exact is not None:
            expected = applied - exact.applied_before
            if lost_commit_replies and processed <= expected:
                parts.append(
                    f"processed {processed:.0f} <= effects since start {expected} (commits "
                    f"whose answer was lost, counted duplicate at their re-run: "
                    f"{expected - processed:.0f})"
                )
            else:
                parts.append(f"processed {processed:.0f} = effects since start {expected}")
                if processed != expected:
                    failures.append(f"metrics: processed {processed:.0f} != {expected} effects")
            if exact is self.epochs[0] and not broker_faults:
                reasons = set(dead_by_reason) | {
                    key.removeprefix("dead:")
                    for lifetime in final
                    for key in lifetime.scraped
                    if key.startswith("dead:")
                }
                for reason in sorted(reasons):
                    counted = sum(lifetime.scraped.get("dead:" + reason, 0.0) for lifetime in final)
                    if counted != dead_by_reason.get(reason, 0):
                        failures.append(
                            f"metrics: dead letters {reason} {counted:.0f} != "
                            f"{dead_by_reason.get(reason, 0)} in the queue"
                        )
                parts.append("dead letters by reason = the queue's")
        else:
            parts.append(
                f"processed {processed:.0f} + {before:.0f} (last scrapes of ended processes) "
                f"<= effects {applied}"
            )
        return "; ".join(parts), failures
