"""Messages a cluster's quorum queues hold for their at-least-once dead-letter workers, and the
runbook's step that gets them forwarded (deploy/runbooks/DeadLetteringStuck.md).

After a leader change (RabbitMQ 3.10.8) the new leader's dead-letter worker can forward its first
window of messages while the target queue has no leader yet: rejected, they wait for the worker's
publisher-confirm timeout (3 minutes), and its window (32) being full, nothing else is forwarded
meanwhile. The queue looks empty (neither ready nor unacked) and the runner, quiet for seconds,
would end there. So once the queues are quiet it asks each queue what it holds, applies the step
to those that hold some and waits until they are forwarded, before the end state is read: the
losses are counted after the recovery, and the raw count stays in the report.
"""

from __future__ import annotations

import asyncio
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

from tests.servers import ThrowawayRabbitCluster

FORWARD_WAIT = 60.0
"""How long the step's forwarding may take (it takes a second or two: an election)."""


@dataclass
class Stranding:
    """What the queues held when they were quiet, and what they still held after the step."""

    held: dict[str, int] = field(default_factory=dict)
    left: dict[str, int] = field(default_factory=dict)
    steps: dict[str, str] = field(default_factory=dict)
    """What the step's ``eval`` answered, by queue (``ok``)."""
    seconds: float = 0.0
    """From the step until nothing was held (or :data:`FORWARD_WAIT` ran out)."""

    @property
    def stranded(self) -> int:
        return sum(self.held.values())

    @property
    def recovered(self) -> int:
        return self.stranded - sum(self.left.values())

    def notes(self) -> list[str]:
        return [
            f"{queue}: RabbitMQ held {count} messages in its at-least-once dead-lettering "
            f"once the queues were quiet (not ready, so not 'left'); the runbook's step "
            f"(DeadLetteringStuck: restart the queue's leader member) had "
            f"{count - self.left.get(queue, 0)} forwarded within {self.seconds:.1f}s "
            f"(it answered {self.steps.get(queue, '?')!r})"
            for queue, count in self.held.items()
        ]


async def _backlog(cluster: ThrowawayRabbitCluster, queue: str) -> int | str:
    """What ``queue`` holds for its dead-letter worker, or why nobody could say (a member in an
    election, a node down)."""
    try:
        return await asyncio.to_thread(cluster.dead_letter_backlog, queue)
    except (RuntimeError, subprocess.SubprocessError) as error:
        return str(error)


async def held_back(
    cluster: ThrowawayRabbitCluster, queues: Sequence[str], notes: list[str]
) -> dict[str, int]:
    """The queues that hold messages for their dead-letter workers, with how many."""
    held: dict[str, int] = {}
    for queue in queues:
        count = await _backlog(cluster, queue)
        if isinstance(count, str):
            notes.append(f"{queue}: dead-letter backlog unknown ({count})")
        elif count:
            held[queue] = count
    return held


async def recover(
    cluster: ThrowawayRabbitCluster, held: dict[str, int], *, timeout: float = FORWARD_WAIT
) -> Stranding:
    """Apply the runbook's step to every queue in ``held``; wait until none holds anything."""
    stranding = Stranding(held=dict(held))
    began = time.monotonic()
    for queue in held:
        try:
            stranding.steps[queue] = await asyncio.to_thread(cluster.restart_leader_member, queue)
        except (RuntimeError, subprocess.SubprocessError) as error:
            stranding.steps[queue] = f"failed: {error}"
    left = dict(held)
    while left and time.monotonic() - began < timeout:
        await asyncio.sleep(1)
        # A queue that cannot say yet (its election) keeps its count until it can.
        now = {queue: await _backlog(cluster, queue) for queue in left}
        left = {q: n if isinstance(n, int) else left[q] for q, n in now.items()}
        left = {q: n for q, n in left.items() if n}
    stranding.left = left
    stranding.seconds = time.monotonic() - began
    return stranding
