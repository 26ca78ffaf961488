"""The clock-skew fault: the consumers' wall clock moved while they run (libfaketime reads its
offset file at every clock reading), the database's left on the true time."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from tests.chaos.world import World

SKEW_WARNING = "clock skew past CONSUMER_MAX_CLOCK_SKEW"
"""The start of the warning a prune round logs when it measures the skew past the limit."""
WARN_WITHIN = 20.0
"""How long the consumers get to say so: prune rounds every second here."""


@dataclass(frozen=True)
class SkewClock:
    """Move every consumer's clock ``offset`` (``+10m``, ``-10m``) from the true time, for the
    rest of the scenario; each running consumer must warn of it (a violation otherwise)."""

    offset: str

    @property
    def label(self) -> str:
        return f"the consumers' clock moved {self.offset} from the database's"

    @property
    def cuts_broker_links(self) -> bool:
        return False

    async def inject(self, world: World) -> None:
        if world.clock_file is None:
            raise RuntimeError("this fault needs a scenario whose consumers run under libfaketime")
        before = {index: self._warnings(world, index) for index in range(len(world.services))}
        world.clock_file.write_text(self.offset)
        deadline = time.monotonic() + WARN_WITHIN
        silent = set(before)
        while silent and time.monotonic() < deadline:
            silent = {
                index
                for index in silent
                if world.alive(index) and self._warnings(world, index) <= before[index]
            }
            await asyncio.sleep(0.2)
        world.violations += [
            f"consumer-{index} did not warn of a clock {self.offset} off within {WARN_WITHIN:g}s"
            for index in sorted(silent)
        ]

    @staticmethod
    def _warnings(world: World, index: int) -> int:
        return sum(
            1
            for line in world.services[index].log_lines()
            if str(line.get("event", "")).startswith(SKEW_WARNING)
        )
