"""The network faults of the lab's scenarios (:mod:`.netsite`), and what the report says of each:
how long the service took to notice a cut, and to commit again once it healed."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass
from datetime import UTC, datetime

import asyncpg

from tests.chaos.network import Direction
from tests.chaos.world import Partition, World


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
        lab = world.need_net().lab
        partition = Partition(self.label, datetime.now(UTC))
        world.partitions.append(partition)
        lab.cut(self.a, self.b, self.direction)
        try:
            await asyncio.sleep(self.seconds)
        finally:
            lab.heal()
            partition.healed_at = datetime.now(UTC)
        await world.wait_ready()


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
            findings.append(f"{partition.label}: {detect}; {resume}")
    finally:
        await conn.close()
    return findings
