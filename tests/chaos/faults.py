"""The faults a scenario injects while events flow. Each waits until the consumers are ready again.

Every server-side fault acts on the run's throwaway servers (:mod:`tests.servers`), never on the
shared RabbitMQ and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, ClassVar, Literal, Protocol

from tests.chaos.relay_kill import kills_recorded
from tests.chaos.world import World
from tests.servers import ThrowawayRabbit


class Fault(Protocol):
    @property
    def label(self) -> str: ...

    @property
    def cuts_broker_links(self) -> bool:
        """It can fall between a publisher confirm and the ack of the original (an extra copy)."""
        ...

    async def inject(self, world: World) -> None: ...


@dataclass(frozen=True)
class Kill:
    """SIGKILL one consumer, then (by default) start it again, as a supervisor would."""

    consumer: int = 0
    restart: bool = True
    down_s: float = 0.3

    @property
    def label(self) -> str:
        return f"SIGKILL consumer-{self.consumer}" + ("" if self.restart else " (left dead)")

    @property
    def cuts_broker_links(self) -> bool:
        return True

    async def inject(self, world: World) -> None:
        await world.kill(self.consumer)
        if self.restart:
            await asyncio.sleep(self.down_s)
            await world.start(self.consumer)


@dataclass(frozen=True)
class RelayKill:
    """Arm consumer ``consumer``'s relay (:mod:`.relay_kill`): at its next round with confirmed
    rows its process SIGKILLs itself between the confirms and the mark, leaving rows published
    and not marked sent; then start it again, as a supervisor would. A kill that does not land
    within ``land_within`` seconds is a violation (the scenario proves nothing then)."""

    consumer: int = 0
    land_within: float = 60.0
    needs_stream: ClassVar[bool] = True
    """The runner opens the stream's gate before this fault, not after: it strikes at the
    relay's next round with rows, and a stream held at the gate could leave the relay none (the
    consumers drain the few events past the fault's point within a fraction of a second on a
    quiet machine)."""

    @property
    def label(self) -> str:
        return f"consumer-{self.consumer}'s relay SIGKILLed between a confirm and the mark"

    @property
    def cuts_broker_links(self) -> bool:
        return True

    async def inject(self, world: World) -> None:
        arm, record = world.relay_files(self.consumer)
        before = len(kills_recorded(record))
        arm.touch()
        deadline = time.monotonic() + self.land_within
        while len(kills_recorded(record)) == before or world.alive(self.consumer):
            if time.monotonic() > deadline:
                arm.unlink(missing_ok=True)
                world.violations.append(
                    f"{self.label}: the kill did not land within {self.land_within:g}s"
                )
                return
            await asyncio.sleep(0.05)
        await world.revive_crashed()
        await world.wait_ready(self.consumer)


@dataclass(frozen=True)
class Terminate:
    """SIGTERM one consumer (it drains and exits 0), then start it again."""

    consumer: int = 0

    @property
    def label(self) -> str:
        return f"SIGTERM consumer-{self.consumer} + restart"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        await world.terminate(self.consumer)
        await world.start(self.consumer)


@dataclass(frozen=True)
class CloseConnections:
    """``rabbitmqctl close_all_connections``: the producer's too."""

    @property
    def label(self) -> str:
        return "broker closes all connections"

    @property
    def cuts_broker_links(self) -> bool:
        return True

    async def inject(self, world: World) -> None:
        await asyncio.to_thread(world.rabbit.close_all_connections)
        await asyncio.sleep(0.5)
        await world.wait_ready()


@dataclass(frozen=True)
class RestartRabbit:
    """Stop the RabbitMQ node and start it again (its quorum queues survive on disk)."""

    @property
    def label(self) -> str:
        return "RabbitMQ restart"

    @property
    def cuts_broker_links(self) -> bool:
        return True

    async def inject(self, world: World) -> None:
        await asyncio.to_thread(world.rabbit.restart)
        await world.wait_ready()


@dataclass(frozen=True)
class RestartPostgres:
    """Stop PostgreSQL (fast shutdown: sessions are cut), wait, start it again."""

    down_s: float = 1.5

    @property
    def label(self) -> str:
        return "PostgreSQL restart"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        await asyncio.to_thread(world.postgres.stop)
        try:
            await asyncio.sleep(self.down_s)
        finally:
            await asyncio.to_thread(world.postgres.start)
        await world.wait_ready()


@dataclass(frozen=True)
class FreezePostgres:
    """SIGSTOP every PostgreSQL process for longer than the handler timeout, then SIGCONT."""

    seconds: float = 4.0

    @property
    def label(self) -> str:
        return f"PostgreSQL frozen {self.seconds:g}s"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        world.postgres.signal_all(signal.SIGSTOP)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            world.postgres.signal_all(signal.SIGCONT)
        await world.wait_ready()


Resource = Literal["memory", "disk"]

# How each alarm is raised and the node's default restored (the throwaway node runs with an empty
# rabbitmq.conf: a relative memory watermark of 0.4, a disk free limit of 50MB), as Erlang calls:
# what `rabbitmqctl set_vm_memory_high_watermark 0` and `set_disk_free_limit 1000000GB` do. Both
# alarms work on 3.10; a watermark of 0 raises the memory alarm at once.
_LIMITS: dict[Resource, tuple[str, str]] = {
    "memory": (
        "vm_memory_monitor:set_vm_memory_high_watermark(0.0)",
        "vm_memory_monitor:set_vm_memory_high_watermark(0.4)",
    ),
    "disk": (
        'rabbit_disk_monitor:set_disk_free_limit("1000000GB")',
        'rabbit_disk_monitor:set_disk_free_limit("50MB")',
    ),
}
# Polls the node's alarms every 100ms, up to N times, until the resource's alarm is (not) set.
_WAIT = (
    "Wait = fun W(Res, Want, N) -> "
    "Has = lists:keymember({resource_limit, Res, node()}, 1, rabbit_alarm:get_alarms()), "
    "if Has =:= Want -> ok; N =:= 0 -> timeout; true -> timer:sleep(100), W(Res, Want, N - 1) "
    "end end, "
)


def _eval(rabbit: ThrowawayRabbit, expression: str, timeout: float) -> str:
    done = subprocess.run(
        [*rabbit.ctl_command(), "eval", expression],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    )
    return done.stdout.strip()


def clear_alarms(rabbit: ThrowawayRabbit) -> None:
    """Restore both limits (in case an alarm was left raised)."""
    _eval(rabbit, ", ".join(clear for _, clear in _LIMITS.values()) + ".", timeout=60)


@dataclass(frozen=True)
class BrokerAlarm:
    """A resource alarm on the run's RabbitMQ node for ``seconds``, then the limit restored: the
    broker blocks every connection that publishes (the producer's, and the consumers' retry and
    dead-letter publishes) until it clears.

    One ``rabbitmqctl eval`` raises it, waits until the node reports it, holds it, restores the
    limit and waits until it is gone: the node clears it even if the runner is stopped meanwhile.
    """

    seconds: float = 5.0
    resource: Resource = "memory"

    @property
    def label(self) -> str:
        return f"RabbitMQ {self.resource} alarm {self.seconds:g}s"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        raise_alarm, clear = _LIMITS[self.resource]
        resource = self.resource
        expression = (
            f"{_WAIT}{raise_alarm}, Up = Wait({resource}, true, 150), "
            f"timer:sleep({round(self.seconds * 1000)}), "
            f"{clear}, Down = Wait({resource}, false, 150), {{Up, Down}}."
        )
        answer = await asyncio.to_thread(_eval, world.rabbit, expression, self.seconds + 60)
        if answer != "{ok,ok}":
            await asyncio.to_thread(clear_alarms, world.rabbit)
            raise RuntimeError(f"the {resource} alarm was not raised and cleared: {answer}")
        await world.wait_ready()


NodeChoice = Literal["leader", "connected", "shard-leader"]
"""Which cluster node a fault strikes: the one leading the work queue, the one consumer-0 is
connected to, or one leading shards of a sharded queue (:meth:`World.node_of`)."""


@dataclass(frozen=True)
class KillNode:
    """SIGKILL one node of the cluster (no goodbye to the others or to clients), then start it
    again: it rejoins, and its replicas catch up. ``flowing``: the stream is not held meanwhile
    (the node's return runs in the background, :attr:`World.background`), so events keep coming
    to the queues the node did not lead while it is down."""

    target: NodeChoice = "leader"
    down_s: float = 2.0
    flowing: bool = False

    @property
    def label(self) -> str:
        return f"SIGKILL the {self.target} node + restart"

    @property
    def cuts_broker_links(self) -> bool:
        return True

    async def inject(self, world: World) -> None:
        cluster = world.need_cluster()
        index = await world.node_of(self.target)
        await asyncio.to_thread(cluster.kill, index)

        async def back() -> None:
            await asyncio.sleep(self.down_s)
            await asyncio.to_thread(cluster.start_node, index)
            await asyncio.to_thread(cluster.await_members, len(cluster.nodes))
            await world.wait_ready()

        await _after(world, back(), self.flowing, "node back")


@dataclass(frozen=True)
class FreezeNode:
    """SIGSTOP one node for ``seconds``, then SIGCONT: to the others (below Erlang's 60s net tick
    time) and to its clients it stops answering, as behind a partition."""

    seconds: float
    target: NodeChoice = "leader"
    flowing: bool = False
    """The stream is not held meanwhile (as :class:`KillNode`'s)."""

    @property
    def label(self) -> str:
        return f"SIGSTOP the {self.target} node {self.seconds:g}s"

    @property
    def cuts_broker_links(self) -> bool:
        return True

    async def inject(self, world: World) -> None:
        cluster = world.need_cluster()
        index = await world.node_of(self.target)
        cluster.freeze(index)

        async def thawed() -> None:
            try:
                await asyncio.sleep(self.seconds)
            finally:
                cluster.thaw(index)
            await asyncio.to_thread(cluster.await_members, len(cluster.nodes))
            await world.wait_ready()

        await _after(world, thawed(), self.flowing, "node thawed")


async def _after(world: World, rest: Coroutine[Any, Any, None], flowing: bool, name: str) -> None:
    """The rest of a node fault: awaited (the stream held at its gate meanwhile), or, flowing,
    left to the background (the runner awaits it before the queues settle)."""
    if flowing:
        world.background.append(asyncio.create_task(rest, name=name))
    else:
        await rest


@dataclass(frozen=True)
class RollingRestart:
    """Stop and start every node in turn, each back in the cluster before the next goes."""

    @property
    def label(self) -> str:
        return "rolling restart of the cluster"

    @property
    def cuts_broker_links(self) -> bool:
        return True

    async def inject(self, world: World) -> None:
        cluster = world.need_cluster()
        for index in range(len(cluster.nodes)):
            await asyncio.to_thread(cluster.stop, index)
            await asyncio.to_thread(cluster.start_node, index)
            await asyncio.to_thread(cluster.await_members, len(cluster.nodes))
        await world.wait_ready()


@dataclass(frozen=True)
class FailoverPostgres:
    """The standby falls behind (the primary's WAL sender stopped for ``lag_s``, as over a slow
    link), the primary is SIGKILLed, then the standby is promoted: the service's multi-host DSN
    finds the new primary once it takes writes. With synchronous replication the primary's
    commits wait for the standby meanwhile; with asynchronous replication those acked while it
    lagged are on the dead primary only."""

    lag_s: float = 2.0
    promote_after_s: float = 1.0

    @property
    def label(self) -> str:
        return f"standby {self.lag_s:g}s behind, primary SIGKILLed, standby promoted"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        pair = world.need_pair()
        await asyncio.to_thread(pair.hold_replication)
        await asyncio.sleep(self.lag_s)
        await asyncio.to_thread(pair.kill_primary)
        # The consumers meet the dead primary before there is a new one.
        await asyncio.sleep(self.promote_after_s)
        await asyncio.to_thread(pair.promote_standby)
        await world.wait_ready()
