"""The names of everything the service owns on the broker, derived from ``CONSUMER_NAME``, and
the headers its exchanges route on."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta

from topology.durations import format_duration

__all__ = [
    "ORIGINAL_ROUTING_KEY",
    "RETRY_RUNG",
    "SHARD",
    "SHARD_KEY",
    "Names",
    "rung_label",
    "shard_label",
]

RETRY_RUNG = "consumer-retry-rung"
"""The header a retry copy carries its rung in (``5s``); the retry exchange routes on it."""

ORIGINAL_ROUTING_KEY = "consumer-original-routing-key"
"""The header every retry copy carries the routing key (the event type) it first came with in: a
migration that splits a queue's types among several routes its retry exchange on it too."""

SHARD_KEY = "consumer-shard-key"
"""The header a sharded queue's hash exchange hashes: what the event's handler locks (its
``key``), else the event id; events with equal keys go to the same shard."""

SHARD = "consumer-shard"
"""The header a retry copy carries its shard in (``s2``): the redeliver exchange of a sharded
queue routes on it, so that a retried event comes back to the shard it came from."""


def shard_label(shard: int) -> str:
    """A shard's name part, and the value of :data:`SHARD` for it: ``s1``, ``s2``, ..."""
    return f"s{shard}"


def rung_label(delay: timedelta) -> str:
    """A rung's name part, and the value of :data:`RETRY_RUNG` for it: ``1s``, ``500ms``, ``2m``."""
    return format_duration(delay)


@dataclass(frozen=True, slots=True)
class Names:
    """Queue and exchange names for a service called ``service`` reading from ``ingress``; for
    one ``queue`` of its queue table, each name has the queue's after the service's
    (``svc.sms.work``, ``svc.sms.dead``): the queue-less service keeps ``svc.work``."""

    service: str
    ingress: str
    work_version: int = 1
    """The work queue's generation: RabbitMQ cannot change a queue's arguments, so a new
    delivery limit is a new queue (``consumer topology migrate`` moves an install to it)."""
    queue: str | None = None
    """The queue table's row these names are for; ``None``: the service without a table."""

    @property
    def prefix(self) -> str:
        """What every name starts with: ``svc``, or ``svc.<queue>``."""
        return self.service if self.queue is None else f"{self.service}.{self.queue}"

    @property
    def work(self) -> str:
        """The quorum queue the service consumes: ``svc.work``, then ``svc.work.v2``, ..."""
        return self.work_queue(self.work_version)

    def work_queue(self, version: int) -> str:
        """The work queue of one generation (the first keeps the name it always had)."""
        return f"{self.prefix}.work" if version == 1 else f"{self.prefix}.work.v{version}"

    @property
    def dlx(self) -> str:
        """The dead-letter exchange: poison, delivery-limit drops and published dead letters."""
        return f"{self.prefix}.dlx"

    @property
    def dead(self) -> str:
        """The operator's queue behind the dead-letter exchange."""
        return f"{self.prefix}.dead"

    @property
    def retry(self) -> str:
        """The headers exchange a failed event is published to; a header picks the rung."""
        return f"{self.prefix}.retry"

    @property
    def redeliver(self) -> str:
        """The exchange expired retries are dead-lettered through: bound to the work queue only."""
        return f"{self.prefix}.redeliver"

    @property
    def hash(self) -> str:
        """A sharded queue's consistent-hash exchange: the ingress routes its types there, and it
        spreads them over the shards by :data:`SHARD_KEY`."""
        return f"{self.prefix}.hash"

    def shard(self, shard: int) -> str:
        """One shard of a sharded work queue (counted from 1): ``svc.q.work.s1``, ..."""
        return f"{self.work}.{shard_label(shard)}"

    def rung(self, delay: timedelta) -> str:
        """The delay queue for one rung of the retry ladder, e.g. ``svc.retry.5s``."""
        return f"{self.prefix}.retry.{format_duration(delay)}"
