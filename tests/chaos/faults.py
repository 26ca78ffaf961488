"""The faults a scenario injects while events flow. Each waits until the consumers are ready again.

Every server-side fault acts on the run's throwaway servers (:mod:`tests.servers`), never on the
shared RabbitMQ and PostgreSQL.
"""

from __future__ import annotations

import asyncio
import signal
from dataclasses import dataclass
from typing import Protocol

from tests.chaos.world import World


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
