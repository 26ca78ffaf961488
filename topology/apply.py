"""Declare a :class:`~topology.model.Topology` on the broker, or check what is there.

AMQP cannot read a queue's arguments back, but a declaration with the wrong ones is refused with a
``PRECONDITION_FAILED`` that names one differing argument and its current value.
:func:`find_conflicts` re-declares with that value taken over until the declaration is accepted:
an equivalent re-declaration changes nothing, so this lists every difference without touching the
queue.

An exchange type a plugin provides (``x-consistent-hash``, for a sharded queue) is refused by a
broker without the plugin with a connection error, ``COMMAND_INVALID``: :func:`apply_topology`
declares such exchanges before anything else, so that a refusal (:class:`ExchangeTypeMissing`)
leaves nothing of the plan half declared.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import aiormq
from aio_pika.abc import AbstractChannel, AbstractConnection
from aio_pika.abc import ExchangeType as AmqpExchangeType

from topology.model import Binding, Exchange, Queue, QueueType, Topology

__all__ = [
    "ApplyReport",
    "Difference",
    "ExchangeTypeMissing",
    "apply_topology",
    "find_conflicts",
    "missing",
    "present_queues",
    "set_binding",
]

_INEQUIVALENT = re.compile(
    r"inequivalent arg '(?P<argument>[^']+)' for (?P<kind>queue|exchange) '(?P<name>[^']*)'"
    r" in vhost '[^']*': received (?P<received>.+?) but current is (?P<current>.+)$"
)
_TYPED_VALUE = re.compile(r"^the value '(?P<value>.*)' of type '(?P<type>[^']+)'$")
_QUOTED_VALUE = re.compile(r"^'(?P<value>.*)'$")
_INTEGER_TYPES = frozenset(
    {"byte", "unsignedbyte", "short", "unsignedshort", "signedint", "unsignedint", "long"}
)
_MAX_PROBES = 32


class ExchangeTypeMissing(Exception):
    """The broker refused an exchange of the plan for its type: the plugin that provides the
    type is not enabled. The message is one line that says which and how to enable it."""

    def __init__(self, exchange: Exchange) -> None:
        self.exchange = exchange
        plugin = exchange.plugin or "a plugin"
        super().__init__(
            f"RabbitMQ has no exchange type {exchange.type.value}, which {exchange.name} needs: "
            f"enable the plugin {plugin} on every node (rabbitmq-plugins enable {plugin}), "
            "then apply again"
        )


@dataclass(frozen=True, slots=True)
class Difference:
    """One argument of an existing queue or exchange that differs from the plan."""

    kind: str
    name: str
    argument: str
    current: str
    wanted: str

    def describe(self) -> str:
        return (
            f"{self.kind} {self.name}: {self.argument} is {self.current}, "
            f"the plan wants {self.wanted}"
        )


@dataclass(frozen=True, slots=True)
class ApplyReport:
    """What applying a plan did; with ``conflicts``, nothing (an existing queue or exchange
    differs from the plan, and a declaration cannot change its arguments)."""

    created: tuple[str, ...] = ()
    unchanged: tuple[str, ...] = ()
    bindings: int = 0
    conflicts: tuple[Difference, ...] = ()


def _parse_value(text: str) -> tuple[str, Any]:
    """RabbitMQ's description of an argument value -> (as shown, as Python), or ("none", None)."""
    text = text.strip()
    if text == "none":
        return "none", None
    typed = _TYPED_VALUE.match(text)
    if typed:
        value, kind = typed["value"], typed["type"]
        if kind in _INTEGER_TYPES:
            return value, int(value)
        if kind == "bool":
            return value, value == "true"
        if kind in ("float", "double"):
            return value, float(value)
        return value, value
    quoted = _QUOTED_VALUE.match(text)
    raw = quoted["value"] if quoted else text
    if raw in ("true", "false"):
        return raw, raw == "true"
    try:
        return raw, int(raw)
    except ValueError:
        return raw, raw


async def _fresh_channel(connection: AbstractConnection) -> AbstractChannel:
    # A refused declaration closes its channel: every probe gets its own.
    return await connection.channel(publisher_confirms=False)


async def _exists(connection: AbstractConnection, thing: Exchange | Queue) -> bool:
    channel = await _fresh_channel(connection)
    try:
        if isinstance(thing, Queue):
            await channel.declare_queue(thing.name, passive=True)
        else:
            await channel.declare_exchange(thing.name, passive=True)
    except aiormq.exceptions.ChannelNotFoundEntity:
        return False
    finally:
        if not channel.is_closed:
            await channel.close()
    return True


async def _declare(
    channel: AbstractChannel, thing: Exchange | Queue, values: dict[str, Any]
) -> None:
    if isinstance(thing, Queue):
        arguments = {k: v for k, v in values.items() if k != "durable"}
        await channel.declare_queue(thing.name, durable=values["durable"], arguments=arguments)
        return
    arguments = {k: v for k, v in values.items() if k not in ("type", "durable")}
    try:
        await channel.declare_exchange(
            thing.name,
            type=AmqpExchangeType(values["type"]),
            durable=values["durable"],
            arguments=arguments or None,
        )
    except aiormq.exceptions.ConnectionCommandInvalid as error:
        # An unknown exchange type is the one COMMAND_INVALID a declaration of a valid name
        # gets: for a type a plugin provides, the plugin is off.
        if thing.plugin is None:
            raise
        raise ExchangeTypeMissing(thing) from error


def _wanted(thing: Exchange | Queue) -> dict[str, Any]:
    if isinstance(thing, Queue):
        return {**thing.declare_arguments, "durable": thing.durable}
    return {"type": thing.type.value, "durable": thing.durable, **thing.arguments}


async def _differences(connection: AbstractConnection, thing: Exchange | Queue) -> list[Difference]:
    kind = "queue" if isinstance(thing, Queue) else "exchange"
    wanted = _wanted(thing)
    candidate = dict(wanted)
    found: list[Difference] = []
    for _ in range(_MAX_PROBES):
        channel = await _fresh_channel(connection)
        try:
            await _declare(channel, thing, candidate)
            return found
        except aiormq.exceptions.ChannelPreconditionFailed as error:
            reason = str(error.args[0] if error.args else error)
            match = _INEQUIVALENT.search(reason)
            if match is None or match["argument"] in {d.argument for d in found}:
                found.append(Difference(kind, thing.name, "?", reason, "the plan"))
                return found
            argument = match["argument"]
            shown, current = _parse_value(match["current"])
            found.append(Difference(kind, thing.name, argument, shown, _show(wanted.get(argument))))
            if current is None:
                candidate.pop(argument, None)
            else:
                candidate[argument] = current
        finally:
            if not channel.is_closed:
                await channel.close()
    return found


def _show(value: object) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    return str(value)


async def find_conflicts(connection: AbstractConnection, topology: Topology) -> list[Difference]:
    """Every argument of an existing exchange or queue that differs from the plan; no changes."""
    differences: list[Difference] = []
    for thing in topology.declarables:
        if await _exists(connection, thing):
            differences.extend(await _differences(connection, thing))
    return differences


async def apply_topology(connection: AbstractConnection, topology: Topology) -> ApplyReport:
    """Declare everything in the plan; or, when an existing exchange or queue differs from it,
    nothing, and say what differs (:attr:`ApplyReport.conflicts`)."""
    differences = await find_conflicts(connection, topology)
    if differences:
        return ApplyReport(conflicts=tuple(differences))
    created: list[str] = []
    unchanged: list[str] = []
    for thing in topology.declarables:
        (unchanged if await _exists(connection, thing) else created).append(thing.describe())
    channel = await connection.channel()
    try:
        # A plugin's types first: a broker without the plugin refuses before anything is made.
        for exchange in sorted(topology.exchanges, key=lambda e: e.plugin is None):
            await _declare(channel, exchange, _wanted(exchange))
        for queue in topology.queues:
            await _declare(channel, queue, _wanted(queue))
        underlay = await channel.get_underlay_channel()
        for binding in topology.bindings:
            await set_binding(underlay, binding)
        # After the bindings, so that nothing is routed nowhere meanwhile; RabbitMQ takes the
        # removal of a binding it does not have as done.
        for binding in topology.unbindings:
            await set_binding(underlay, binding, remove=True)
    finally:
        if not channel.is_closed:
            await channel.close()
    return ApplyReport(tuple(created), tuple(unchanged), len(topology.bindings))


async def set_binding(underlay: Any, binding: Binding, *, remove: bool = False) -> None:
    """Make ``binding`` (to a queue, or to an exchange) on the raw channel ``underlay``, or with
    ``remove`` remove it."""
    arguments = dict(binding.arguments)
    key = binding.routing_key
    if binding.to_exchange and remove:
        await underlay.exchange_unbind(binding.queue, binding.exchange, key, arguments=arguments)
    elif binding.to_exchange:
        await underlay.exchange_bind(binding.queue, binding.exchange, key, arguments=arguments)
    elif remove:
        await underlay.queue_unbind(binding.queue, binding.exchange, key, arguments=arguments)
    else:
        await underlay.queue_bind(binding.queue, binding.exchange, key, arguments=arguments)


async def present_queues(connection: AbstractConnection, names: Iterable[str]) -> list[str]:
    """Which of the queues ``names`` the broker has (passive declarations)."""
    return [name for name in names if await _exists(connection, Queue(name, QueueType.QUORUM))]


async def missing(connection: AbstractConnection, topology: Topology) -> list[str]:
    """What of the plan's exchanges and queues the broker lacks (passive declarations)."""
    return [
        thing.describe() for thing in topology.declarables if not await _exists(connection, thing)
    ]
