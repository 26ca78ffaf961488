"""The faults a scenario injects while events flow. Each waits until the consumers are ready again.

Every server-side fault acts on the run's throwaway servers (:mod:`tests.servers`), never on the
shared RabbitMQ and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import time
from dataclasses import dataclass
from typing import Literal, Protocol

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

# rabbitmqctl arguments that raise each alarm at once, and those that restore the node's defaults
# (the throwaway node runs with an empty rabbitmq.conf: a relative memory watermark of 0.4 and a
# disk free limit of 50MB). A watermark of 0 raises the memory alarm at once; the disk alarm
# follows the limit at the disk monitor's next check (about a second). Both work on 3.10.
_ALARMS: dict[Resource, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "memory": (("set_vm_memory_high_watermark", "0"), ("set_vm_memory_high_watermark", "0.4")),
    "disk": (("set_disk_free_limit", "1000000GB"), ("set_disk_free_limit", "50MB")),
}
ALARM_TIMEOUT = 15.0
"""How long an alarm may take to show (or go) after the limit is set."""


def _rabbitmqctl(rabbit: ThrowawayRabbit, *args: str) -> str:
    done = subprocess.run(
        [*rabbit.ctl_command(), *args], capture_output=True, text=True, timeout=60, check=True
    )
    return done.stdout


def _alarms(rabbit: ThrowawayRabbit) -> str:
    """The node's resource alarms, as Erlang terms (``{resource_limit,memory,Node}``...)."""
    return _rabbitmqctl(rabbit, "eval", "rabbit_alarm:get_alarms().")


def _wait_for_alarm(rabbit: ThrowawayRabbit, resource: Resource, *, raised: bool) -> None:
    deadline = time.monotonic() + ALARM_TIMEOUT
    while (f"resource_limit,{resource}," in _alarms(rabbit)) != raised:
        if time.monotonic() > deadline:
            state = "raised" if raised else "cleared"
            raise RuntimeError(f"the {resource} alarm was not {state} within {ALARM_TIMEOUT:g}s")
        time.sleep(0.3)


def clear_alarms(rabbit: ThrowawayRabbit) -> None:
    """Restore both limits (whatever a fault cut short left behind)."""
    for _, clear in _ALARMS.values():
        _rabbitmqctl(rabbit, *clear)


@dataclass(frozen=True)
class BrokerAlarm:
    """A resource alarm on the run's RabbitMQ node for ``seconds``, then the limit restored: the
    broker blocks every connection that publishes (the producer's, and the consumers' retry and
    dead-letter publishes) until it clears."""

    seconds: float = 5.0
    resource: Resource = "memory"

    @property
    def label(self) -> str:
        return f"RabbitMQ {self.resource} alarm {self.seconds:g}s"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        raise_alarm, clear = _ALARMS[self.resource]
        try:
            await asyncio.to_thread(_rabbitmqctl, world.rabbit, *raise_alarm)
            await asyncio.to_thread(_wait_for_alarm, world.rabbit, self.resource, raised=True)
            await asyncio.sleep(self.seconds)
        finally:
            await asyncio.to_thread(_rabbitmqctl, world.rabbit, *clear)
        await asyncio.to_thread(_wait_for_alarm, world.rabbit, self.resource, raised=False)
        await world.wait_ready()
