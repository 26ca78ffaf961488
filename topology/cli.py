"""``consumer topology apply|check`` (also ``python -m topology``): the broker bootstrap."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from typing import Any

import aiormq

from consumer.amqp import BrokerUnreachable, connect, describe_amqp_error
from consumer.errors import TopologyError
from consumer.settings import Settings
from consumer.startup import fail, load_handlers, load_settings
from topology.apply import apply_topology, check_topology, find_conflicts
from topology.model import Topology
from topology.plan import build_topology

_DESCRIPTION = "Declare (or check) the exchanges, queues and bindings the consumer needs."


def add_topology_parser(commands: Any) -> None:
    """``topology`` as a subcommand of ``consumer``."""
    topology = commands.add_parser(
        "topology", help="declare or check the broker topology", description=_DESCRIPTION
    )
    _add_actions(topology)


def _add_actions(parser: argparse.ArgumentParser) -> None:
    actions = parser.add_subparsers(dest="topology_command", required=True)
    apply = actions.add_parser("apply", help="declare everything; a no-op when already there")
    apply.add_argument(
        "--dry-run", action="store_true", help="print the plan; do not connect to the broker"
    )
    actions.add_parser("check", help="report what is missing or differs; change nothing")


async def _apply(settings: Settings, topology: Topology) -> int:
    connection = await connect(settings, "topology")
    try:
        report = await apply_topology(connection, topology)
    finally:
        await connection.close()
    for line in report.created:
        print(f"created {line}")
    for line in report.unchanged:
        print(f"exists  {line}")
    print(f"bound   {report.bindings} bindings")
    return 0


async def _check(settings: Settings, topology: Topology) -> int:
    connection = await connect(settings, "topology")
    try:
        await check_topology(connection, topology)
        differences = await find_conflicts(connection, topology)
    finally:
        await connection.close()
    for difference in differences:
        print(difference.describe())
    if differences:
        return 1
    print("topology is in place")
    return 0


def run_topology(settings: Settings, arguments: argparse.Namespace) -> int:
    registry = load_handlers(settings)
    topology = build_topology(settings, registry)
    if arguments.topology_command == "apply" and arguments.dry_run:
        for line in topology.describe():
            print(line)
        return 0
    runner = _apply if arguments.topology_command == "apply" else _check
    try:
        return asyncio.run(runner(settings, topology))
    except (TopologyError, BrokerUnreachable) as error:
        fail(str(error))
    except aiormq.exceptions.ChannelAccessRefused as error:
        fail(f"RabbitMQ refused: {describe_amqp_error(error)} (the bootstrap user needs configure)")


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m topology``: the same as ``consumer topology``."""
    parser = argparse.ArgumentParser(prog="consumer topology", description=_DESCRIPTION)
    _add_actions(parser)
    arguments = parser.parse_args(argv)
    return run_topology(load_settings(), arguments)
