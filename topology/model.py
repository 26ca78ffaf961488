"""The topology as frozen data: a plan that can be printed, compared and applied."""

from __future__ import annotations

import enum
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

__all__ = [
    "PLUGIN_OF",
    "Arguments",
    "Binding",
    "Exchange",
    "ExchangeType",
    "Queue",
    "QueueType",
    "Topology",
]

Arguments = Mapping[str, Any]


def _frozen(arguments: Mapping[str, Any] | None) -> Arguments:
    return MappingProxyType(dict(arguments or {}))


class ExchangeType(enum.StrEnum):
    TOPIC = "topic"
    FANOUT = "fanout"
    DIRECT = "direct"
    HEADERS = "headers"
    CONSISTENT_HASH = "x-consistent-hash"


PLUGIN_OF: Mapping[str, str] = MappingProxyType(
    {ExchangeType.CONSISTENT_HASH.value: "rabbitmq_consistent_hash_exchange"}
)
"""The broker plugin that provides each exchange type the broker does not have built in."""


class QueueType(enum.StrEnum):
    QUORUM = "quorum"
    CLASSIC = "classic"


@dataclass(frozen=True, slots=True)
class Exchange:
    name: str
    type: ExchangeType
    durable: bool = True
    arguments: Arguments = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", _frozen(self.arguments))

    @property
    def plugin(self) -> str | None:
        """The broker plugin this exchange's type needs (``None``: built in)."""
        return PLUGIN_OF.get(self.type.value)

    def describe(self) -> str:
        arguments = ", ".join(f"{key}={value}" for key, value in sorted(self.arguments.items()))
        durable = ", durable" if self.durable else ""
        extra = f"; {arguments}" if arguments else ""
        return f"exchange {self.name} ({self.type.value}{durable}{extra})"


@dataclass(frozen=True, slots=True)
class Queue:
    name: str
    type: QueueType
    arguments: Arguments = field(default_factory=dict)
    durable: bool = True

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", _frozen(self.arguments))

    @property
    def declare_arguments(self) -> dict[str, Any]:
        """The arguments as declared: the queue type included."""
        return {"x-queue-type": self.type.value, **self.arguments}

    def describe(self) -> str:
        arguments = ", ".join(f"{key}={value}" for key, value in sorted(self.arguments.items()))
        return f"queue {self.name} ({self.type.value}{'; ' + arguments if arguments else ''})"


@dataclass(frozen=True, slots=True)
class Binding:
    """A binding from ``exchange`` to the queue ``queue``, or (``to_exchange``) to the exchange
    of that name."""

    exchange: str
    queue: str
    routing_key: str = ""
    arguments: Arguments = field(default_factory=dict)
    to_exchange: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "arguments", _frozen(self.arguments))

    def describe(self) -> str:
        match = f" where {dict(self.arguments)}" if self.arguments else ""
        key = f" with routing key {self.routing_key!r}" if self.routing_key else ""
        kind = " (exchange)" if self.to_exchange else ""
        return f"bind {self.exchange} -> {self.queue}{key}{match}{kind}"


@dataclass(frozen=True, slots=True)
class Topology:
    """Everything to declare, in an order that declares each thing before what refers to it."""

    exchanges: tuple[Exchange, ...]
    queues: tuple[Queue, ...]
    bindings: tuple[Binding, ...]
    unbindings: tuple[Binding, ...] = ()
    """Bindings that must not be there, removed after the plan's are made when present (a
    migration to fewer shards left them: :mod:`topology.reshard`)."""

    @classmethod
    def merge(cls, parts: Iterable[Topology]) -> Topology:
        """Several plans as one (a queue table's, one plan per queue): an exchange they share
        (the ingress) once; queues and bindings of each, in order."""
        exchanges: dict[str, Exchange] = {}
        queues: list[Queue] = []
        bindings: list[Binding] = []
        unbindings: list[Binding] = []
        for part in parts:
            for exchange in part.exchanges:
                exchanges.setdefault(exchange.name, exchange)
            queues.extend(part.queues)
            bindings.extend(part.bindings)
            unbindings.extend(part.unbindings)
        return cls(tuple(exchanges.values()), tuple(queues), tuple(bindings), tuple(unbindings))

    @property
    def declarables(self) -> tuple[Exchange | Queue, ...]:
        """Exchanges, then queues: what has arguments a declaration can conflict on."""
        return (*self.exchanges, *self.queues)

    def describe(self) -> list[str]:
        """One line per declaration, in the order they are declared."""
        lines = [item.describe() for item in self.declarables]
        return lines + [binding.describe() for binding in self.bindings]
