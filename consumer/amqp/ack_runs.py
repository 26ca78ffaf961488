"""Which acks remove exactly a given set of a channel's deliveries, in as few frames as may be.

Pure: no broker here. ``basic.ack(multiple=True)`` acks every unacked delivery up to its tag, so
it is right only for a run that starts at the oldest delivery not yet acked and holds nothing to
keep: a letter kept, failed, not selected or not yet confirmed stops the run, and every tag after
it is acked singly (still one write for all of them,
:meth:`consumer.cli.dlq.stream.QueueScan.take`). A channel's delivery tags are 1, 2, 3...
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

__all__ = ["AckPlan", "AckRuns"]


@dataclass(frozen=True, slots=True)
class AckPlan:
    up_to: int | None
    """One ``multiple`` ack up to this tag, if any."""
    singles: tuple[int, ...]
    """Each acked alone."""


class AckRuns:
    """The acks already planned on one channel, and the plan for the next tags to remove."""

    def __init__(self) -> None:
        self._floor = 0
        """Every tag up to here is acked."""
        self._above: set[int] = set()
        """Tags acked above the floor (singly, behind one still held)."""

    def acked(self, tag: int) -> bool:
        """Whether ``tag`` is in an ack planned so far. Kept in a floor and the tags above it, so
        what this remembers grows with the tags acked behind one still held, not with all."""
        return tag <= self._floor or tag in self._above

    def plan(self, tags: Iterable[int]) -> AckPlan:
        """The acks that remove ``tags`` (held, none acked before) and nothing else."""
        wanted = sorted(set(tags))
        if (wanted and wanted[0] <= self._floor) or self._above.intersection(wanted):
            raise ValueError("a delivery tag is acked only once")
        fresh = set(wanted)
        up_to: int | None = None
        # The run from the oldest unacked tag: tags of this plan, or acked before (already gone,
        # so a multiple ack passes over them); its ack names the newest tag of this plan in it.
        while True:
            following = self._floor + 1
            if following in fresh:
                up_to = following
            elif following in self._above:
                self._above.discard(following)
            else:
                break
            self._floor = following
        singles = tuple(t for t in wanted if up_to is None or t > up_to)
        self._above.update(singles)
        return AckPlan(up_to, singles)
