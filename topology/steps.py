"""The steps of ``consumer topology migrate``, as frozen data (:mod:`topology.migration_plan` and
:mod:`topology.reshard` make them; :mod:`topology.migrate` carries them out)."""

from __future__ import annotations

from dataclasses import dataclass

from topology.model import Binding, Exchange, Queue
from topology.names import SHARD

__all__ = [
    "Bind",
    "Declare",
    "DeclareExchange",
    "Delete",
    "MigrationPlan",
    "Move",
    "Route",
    "Step",
    "Unbind",
]


@dataclass(frozen=True, slots=True)
class DeclareExchange:
    """An exchange of a queue new to a queue table (:mod:`topology.table_migration`)."""

    exchange: Exchange

    def describe(self) -> str:
        return f"declare {self.exchange.describe()}"


@dataclass(frozen=True, slots=True)
class Declare:
    queue: Queue

    def describe(self) -> str:
        return f"declare {self.queue.describe()}"


@dataclass(frozen=True, slots=True)
class Bind:
    """A binding to a queue, or (``to_exchange``) to an exchange: ``binding.queue`` names it."""

    binding: Binding
    to_exchange: bool = False

    def describe(self) -> str:
        return self.binding.describe() + _exchange_note(self)


@dataclass(frozen=True, slots=True)
class Unbind:
    binding: Binding
    to_exchange: bool = False

    def describe(self) -> str:
        return "un" + self.binding.describe() + _exchange_note(self)


def _exchange_note(step: Bind | Unbind) -> str:
    # A plan's own binding to an exchange says so in its description already.
    return " (exchange)" if step.to_exchange and not step.binding.to_exchange else ""


def _to(exchange: str, rung: str | None) -> str:
    return f"rung {rung} through {exchange}" if rung else f"exchange {exchange}"


@dataclass(frozen=True, slots=True)
class Route:
    """Where a :class:`Move` sends the messages of one event type (their routing key) instead."""

    event_type: str
    exchange: str
    rung: str | None

    def describe(self) -> str:
        return f"{self.event_type} to {_to(self.exchange, self.rung)}"


@dataclass(frozen=True, slots=True)
class Move:
    """Every message of ``source`` to ``exchange``, each copy confirmed before its original is
    acked, with its own routing key, and the header :data:`~topology.names.RETRY_RUNG` set to
    ``rung`` when given (the retry exchange routes on it). ``from_work``: the source is a work
    queue, whose messages are not all the service's own (see :mod:`topology.migrate`).
    ``routes``: the event types that go elsewhere, picked by routing key (the queue of a service
    without a table, whose types a queue table shares among several queues). ``shard``: the
    header :data:`~topology.names.SHARD` set to it (a leaving shard's own label, which the
    redeliver exchange then routes to the hash exchange: :mod:`topology.reshard`).

    Never through the default exchange: the least-privileged bootstrap user may write only to
    the service's own exchanges."""

    source: str
    exchange: str
    rung: str | None
    from_work: bool
    routes: tuple[Route, ...] = ()
    shard: str | None = None

    def destination(self, routing_key: str) -> tuple[str, str | None]:
        """The exchange and rung a message with ``routing_key`` goes to."""
        for route in self.routes:
            if route.event_type == routing_key:
                return route.exchange, route.rung
        return self.exchange, self.rung

    @property
    def exchanges(self) -> tuple[str, ...]:
        """Every exchange this move may publish to."""
        return tuple(dict.fromkeys([self.exchange, *(route.exchange for route in self.routes)]))

    def describe(self) -> str:
        if self.shard is not None:
            return (
                f"move the messages of {self.source} to exchange {self.exchange} as "
                f"{SHARD}: {self.shard}, each to the shard its key has now"
            )
        if not self.routes:
            return f"move the messages of {self.source} to {_to(self.exchange, self.rung)}"
        routes = ", ".join(route.describe() for route in self.routes)
        return (
            f"move the messages of {self.source} by event type: {routes}, the rest to "
            f"{_to(self.exchange, self.rung)}"
        )


@dataclass(frozen=True, slots=True)
class Delete:
    """Delete a queue once it holds nothing; ``unused``: and no one consumes it."""

    queue: str
    unused: bool

    def describe(self) -> str:
        when = "empty and without consumers" if self.unused else "empty"
        return f"delete queue {self.queue} once {when}"


Step = DeclareExchange | Declare | Bind | Unbind | Move | Delete


@dataclass(frozen=True, slots=True)
class MigrationPlan:
    steps: tuple[Step, ...]
    absent: tuple[str, ...] = ()
    """Queues the broker must not have for the steps to be right, checked before the first:
    the shard beyond a resharded queue's count (:mod:`topology.reshard`)."""

    @property
    def changes_nothing(self) -> bool:
        return not self.steps

    def describe(self) -> list[str]:
        """One numbered line per step, as ``--dry-run`` prints them."""
        return [f"{number:>2}. {step.describe()}" for number, step in enumerate(self.steps, 1)]
