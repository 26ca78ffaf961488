"""The topology bootstrap's command line."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence

import aiormq

from consumer.amqp import BrokerUnreachable, connect, describe_amqp_error
from consumer.errors import TopologyError
from consumer.settings import Settings
from consumer.startup import fail, load_handlers, load_settings
from topology.apply import apply_topology, check_topology, find_conflicts
from topology.model import Topology
from topology.plan import build_topology


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m topology",
        description="Declare (or check) the exchanges, queues and bindings the consumer needs.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    apply = commands.add_parser("apply", help="declare everything; a no-op when already there")
    apply.add_argument(
        "--dry-run", action="store_true", help="print the plan; do not connect to the broker"
    )
    commands.add_parser("check", help="report what is missing or differs; change nothing")
    return parser


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


def main(argv: Sequence[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    settings = load_settings()
    registry = load_handlers(settings)
    topology = build_topology(settings, registry)
    if arguments.command == "apply" and arguments.dry_run:
        for line in topology.describe():
            print(line)
        return 0
    runner = _apply if arguments.command == "apply" else _check
    try:
        return asyncio.run(runner(settings, topology))
    except (TopologyError, BrokerUnreachable) as error:
        fail(str(error))
    except aiormq.exceptions.ChannelAccessRefused as error:
        fail(f"RabbitMQ refused: {describe_amqp_error(error)} (the bootstrap user needs configure)")
