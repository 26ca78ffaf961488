"""The network faults of the lab's scenarios (:mod:`.netsite`), and what the report says of each:
how long the service took to notice a cut, and to commit again once it healed."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import asyncpg

from tests.chaos.network import Direction
from tests.chaos.world import Partition, World
from tests.servers import ThrowawayRabbit


@dataclass(frozen=True)
class Cut:
    """Drop, silently (nftables, no RST, no ICMP), what ``a`` and ``b`` send each other (or one
    way: ``to`` is what ``a`` sends ``b``) for ``seconds``, then heal and wait until the
    consumers are ready again."""

    a: str
    b: str
    seconds: float
    direction: Direction = "both"

    @property
    def label(self) -> str:
        arrow = {"both": "<->", "to": "->", "from": "<-"}[self.direction]
        return f"silent cut {self.a}{arrow}{self.b} {self.seconds:g}s"

    @property
    def cuts_broker_links(self) -> bool:
        return "rabbit" in (self.a, self.b)

    async def inject(self, world: World) -> None:
        net = world.need_net()
        lab = net.lab
        partition = Partition(self.label, datetime.now(UTC), server_log_from=_size(net.log))
        world.partitions.append(partition)
        lab.cut(self.a, self.b, self.direction)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            lab.heal()
            partition.healed_at = datetime.now(UTC)
        await world.wait_ready()


@dataclass(frozen=True)
class Degrade:
    """Every link of the service slowed and lossy for ``seconds``: the proxy between it and its
    servers delays each chunk ``delay_ms`` ± ``jitter_ms`` each way, and nftables drops
    ``loss_percent`` of the packets the service and the proxy send (``numgen random``). Needs
    a scenario whose consumers go through the proxy (``via_proxy``)."""

    seconds: float
    delay_ms: int = 100
    jitter_ms: int = 50
    loss_percent: int = 2

    @property
    def label(self) -> str:
        return (
            f"latency {self.delay_ms}±{self.jitter_ms}ms and {self.loss_percent}% loss "
            f"{self.seconds:g}s"
        )

    @property
    def cuts_broker_links(self) -> bool:
        return True  # a lossy link may well end a connection

    async def inject(self, world: World) -> None:
        net = world.need_net()
        if world.proxy_control is None:
            raise RuntimeError("this fault needs the consumers behind the latency proxy")
        partition = Partition(self.label, datetime.now(UTC), server_log_from=_size(net.log))
        world.partitions.append(partition)
        control = world.proxy_control
        control.write_text(f"{self.delay_ms} {self.jitter_ms}")
        for host in ("service", "proxy"):
            net.lab.lose(host, self.loss_percent)

        async def heal_later() -> None:
            try:
                await asyncio.sleep(self.seconds)
            finally:
                net.lab.heal()
                control.write_text("0 0")
                partition.healed_at = datetime.now(UTC)

        # Returns at once, the links still degraded: the stream flows on through them (a cut
        # holds the stream at its gate; here the flow under the fault is what is measured).
        world.background.append(asyncio.create_task(heal_later(), name="degraded"))


NodeChoice = Literal["connected", "leader"]
"""Which node of the lab's cluster a partition cuts off: the one consumer-0 is connected to, or
the one leading the work queue (consumer-0 connected to it too: :attr:`NodePartition.on_leader`)."""


@dataclass(frozen=True)
class NodePartition:
    """One node of the lab's cluster cut off from the other two (nftables drops, both ways,
    between its address and each peer's) for ``seconds``, past Erlang's net tick time, its link
    to the service and the runner left up; then healed, and the fault waits until the cluster
    has its three running members again and the consumers are ready. As with :class:`Degrade`,
    :meth:`inject` returns once the cut is in place and the stream flows on through it (the
    runner awaits the heal before the queues settle): the service must move to the majority and
    commit there while the cut holds. ``target``: the node consumer-0 is connected to, or the
    work queue's leader; ``on_leader``: they must be the same node (the scenario starts
    consumer-0's node list at the leader), else the scenario's premise did not hold and that is
    a violation."""

    seconds: float
    target: NodeChoice = "connected"
    on_leader: bool = False

    @property
    def label(self) -> str:
        which = "the leader node" if self.on_leader else f"the {self.target} node"
        return f"partition: {which} cut off from its 2 peers {self.seconds:g}s"

    @property
    def cuts_broker_links(self) -> bool:
        return True  # pause_minority closes the cut node's client connections

    async def inject(self, world: World) -> None:
        net = world.need_net()
        cluster = world.need_cluster()
        connected = await world.node_of("connected")
        leader = await world.node_of("leader")
        index = connected if self.target == "connected" else leader
        world.notes.append(
            f"{self.label}: node {index + 1} cut off; consumer-0 connected to node "
            f"{connected + 1}, the work queue led by node {leader + 1}"
        )
        if self.on_leader and connected != leader:
            world.violations.append(
                f"the partition was to cut consumer-0's node off while it leads the work queue, "
                f"but consumer-0 is on node {connected + 1} and node {leader + 1} leads"
            )
        cut_off = f"rabbit-{index + 1}"
        peers = [f"rabbit-{n + 1}" for n in range(len(cluster.nodes)) if n != index]
        partition = Partition(self.label, datetime.now(UTC), server_log_from=_size(net.log))
        world.partitions.append(partition)
        node_log_from = _size(_node_log(cluster.nodes[index]))
        try:
            for peer in peers:
                net.lab.cut(cut_off, peer, "both")
        except BaseException:
            net.lab.heal()
            raise

        async def heal_later() -> None:
            try:
                await asyncio.sleep(self.seconds)
            finally:
                net.lab.heal()
                partition.healed_at = datetime.now(UTC)
            await asyncio.to_thread(cluster.await_members, len(cluster.nodes))
            rejoined = datetime.now(UTC)
            await world.wait_ready()
            world.notes.append(
                node_findings(cluster.nodes[index], node_log_from, partition, rejoined)
            )
            world.notes.append(_moved_findings(world, partition))

        world.background.append(asyncio.create_task(heal_later(), name="partitioned"))


def _stamp(line: dict[str, object]) -> datetime:
    return datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))


def _moved_findings(world: World, partition: Partition) -> str:
    """From consumer-0's log: when it lost its node (after the cut), when it committed again
    after that (on the majority, while the cut held, or only after the heal), and how many fresh
    commits the consumers made while the cut held."""
    healed = partition.healed_at or datetime.now(UTC)
    lines = [line for line in world.services[0].log_lines() if "timestamp" in line]
    lost = next(
        (
            _stamp(line)
            for line in lines
            if line.get("event") == "lost RabbitMQ" and _stamp(line) >= partition.cut_at
        ),
        None,
    )
    during = sum(
        1
        for service in world.services
        for line in service.log_lines()
        if line.get("event") == "message settled"
        and line.get("outcome") == "processed"
        and "timestamp" in line
        and partition.cut_at <= _stamp(line) <= healed
    )
    if lost is None:
        return f"consumer-0 kept its connection through the cut; {during} fresh commits during it"
    again = next(
        (
            _stamp(line)
            for line in lines
            if line.get("event") == "message settled"
            and line.get("outcome") == "processed"
            and _stamp(line) > lost
        ),
        None,
    )
    where = (
        "never"
        if again is None
        else f"{(again - lost).total_seconds():.1f}s later"
        + (" (during the cut)" if again <= healed else " (after the heal)")
    )
    return (
        f"consumer-0 lost its node {(lost - partition.cut_at).total_seconds():.1f}s after the "
        f"cut, committed again {where}; {during} fresh commits by the consumers during the cut"
    )


def _node_log(node: ThrowawayRabbit) -> Path:
    return node.base / "log" / f"{node.node}.log"


NODE_SAYS = {
    "peers down": ("node '", "' down"),
    "paused (pause_minority)": ("minority", ""),
    "back": ("rabbit on node '", "' up"),
}
"""What the cut node's log says after the cut, and how to say it: the first line with both
parts (the time it saw a peer down, paused itself, saw a peer's broker come back)."""


def node_findings(
    node: ThrowawayRabbit, log_from: int, partition: Partition, rejoined: datetime
) -> str:
    """When the cut node saw its peers down and paused (from its log, against the cut), and when
    the cluster had all its members back (against the heal)."""
    try:
        with _node_log(node).open("rb") as log:
            log.seek(log_from)
            lines = log.read().decode(errors="replace").splitlines()
    except OSError:
        lines = []
    said: list[str] = []
    for meaning, (first, second) in NODE_SAYS.items():
        for line in lines:
            if first in line and second in line:
                with contextlib.suppress(ValueError):
                    stamp = datetime.fromisoformat(line[:32])
                    origin = partition.cut_at
                    if meaning == "back" and partition.healed_at is not None:
                        origin = partition.healed_at
                    elapsed = (stamp - origin).total_seconds()
                    since = "the heal" if meaning == "back" else "the cut"
                    said.append(f"{meaning} {elapsed:.1f}s after {since}")
                    break
    healed = partition.healed_at or rejoined
    return (
        f"node {node.node}: {', '.join(said) or 'its log says nothing of the cut'}; "
        f"3 running members {(rejoined - healed).total_seconds():.1f}s after the heal"
    )


TRIGGER_WAIT = 10.0
"""How long an armed cut may wait for a COMMIT under load before the fault gives up."""


@dataclass(frozen=True)
class CommitCut:
    """A cut between the service and PostgreSQL that the service's next ``COMMIT`` sets off
    (:meth:`~tests.chaos.network.Lab.cut_at_commit`): so it lands in the middle of one, the
    request arrived and the reply lost (``reply``) or the request lost (``request``). Healed
    ``seconds`` after it went off."""

    lose: Literal["request", "reply"]
    seconds: float

    @property
    def label(self) -> str:
        what = "reply" if self.lose == "reply" else "request"
        return f"silent cut at a COMMIT, its {what} and all after dropped {self.seconds:g}s"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        net = world.need_net()
        lab = net.lab
        log_from = _size(net.log)
        lab.cut_at_commit("service", "postgres", net.postgres.port, self.lose)
        try:
            deadline = time.monotonic() + TRIGGER_WAIT
            while not lab.triggered("service"):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"no COMMIT went to PostgreSQL in {TRIGGER_WAIT:g}s")
                await asyncio.sleep(0.01)
            partition = Partition(self.label, datetime.now(UTC), server_log_from=log_from)
            world.partitions.append(partition)
            await asyncio.sleep(self.seconds)
        finally:
            lab.heal()
        partition.healed_at = datetime.now(UTC)
        await world.wait_ready()


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


SERVER_SAYS = {
    "idle-in-transaction timeout": "ended sessions idle in their transaction",
    "could not receive data from client": "lost clients",
    "unexpected EOF on client connection": "saw clients leave mid-transaction",
}
"""What the lab PostgreSQL's log says of the service's sessions after a cut, and how to say it."""


def _server_findings(world: World, partition: Partition) -> str:
    net = world.need_net()
    try:
        with net.log.open("rb") as log:
            log.seek(partition.server_log_from)
            text = log.read().decode(errors="replace")
    except OSError:
        return ""
    counts = [
        f"{meaning} x{count}"
        for needle, meaning in SERVER_SAYS.items()
        if (count := text.count(needle))
    ]
    return f"; PostgreSQL {', '.join(counts)}" if counts else ""


def _first_loss(world: World, after: datetime, event: str) -> datetime | None:
    """The first consumer log line ``event`` (``lost RabbitMQ``...) at or after ``after``."""
    found: list[datetime] = []
    for service in world.services:
        for line in service.log_lines():
            if line.get("event") != event or "timestamp" not in line:
                continue
            stamp = datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))
            if stamp >= after:
                found.append(stamp)
    return min(found, default=None)


_FIRST_EFFECT_AFTER = "SELECT min(applied_at) FROM test_effects WHERE applied_at > $1"
"""``applied_at`` is ``clock_timestamp()`` in the handler's transaction: its commit follows."""


async def partition_findings(world: World, lost_event: str = "lost RabbitMQ") -> list[str]:
    """Per cut: the time to detect (its first ``lost_event`` log line after the cut) and the time
    to resume (the first effect committed after the heal, by the database's clock)."""
    findings: list[str] = []
    if not world.partitions:
        return findings
    conn = await asyncpg.connect(world.env.database_url, timeout=10)
    try:
        for partition in world.partitions:
            detected = _first_loss(world, partition.cut_at, lost_event)
            detect = (
                f"detected after {(detected - partition.cut_at).total_seconds():.1f}s "
                f"('{lost_event}')"
                if detected is not None
                else f"never detected ('{lost_event}' not logged)"
            )
            resume = "not healed"
            if partition.healed_at is not None:
                first = await conn.fetchval(_FIRST_EFFECT_AFTER, partition.healed_at)
                resume = (
                    "no effect committed after the heal"
                    if first is None
                    else f"first commit {(first - partition.healed_at).total_seconds():.1f}s "
                    "after the heal"
                )
            server = _server_findings(world, partition) if world.net is not None else ""
            findings.append(f"{partition.label}: {detect}; {resume}{server}")
    finally:
        await conn.close()
    return findings


def _settled(world: World) -> list[tuple[datetime, float]]:
    """Each fresh commit the consumers logged: when, and how long from delivery to settling."""
    found: list[tuple[datetime, float]] = []
    for service in world.services:
        for line in service.log_lines():
            if line.get("event") != "message settled" or line.get("outcome") != "processed":
                continue
            stamp = datetime.fromisoformat(str(line["timestamp"]).replace("Z", "+00:00"))
            found.append((stamp, float(line.get("duration_ms", 0.0))))
    return sorted(found)


def _p99(durations: list[float]) -> float:
    ordered = sorted(durations)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))] if ordered else 0.0


def flow_findings(world: World) -> list[str]:
    """Throughput (fresh commits a second) and p99 of their delivery-to-settle time, by the
    consumers' logs: within each fault's stretch, and over the whole stream."""
    settled = _settled(world)
    if not settled:
        return ["flow: no fresh commit logged"]
    windows = [
        (partition.label, partition.cut_at, partition.healed_at)
        for partition in world.partitions
        if partition.healed_at is not None
    ]
    windows.append(("whole stream", settled[0][0], settled[-1][0]))
    findings = []
    for label, start, end in windows:
        inside = [ms for stamp, ms in settled if start <= stamp <= end]
        seconds = max((end - start).total_seconds(), 0.001)
        findings.append(
            f"flow, {label}: {len(inside)} fresh commits in {seconds:.1f}s "
            f"({len(inside) / seconds:.0f}/s), p99 delivery to settle {_p99(inside):.0f} ms"
        )
    return findings
