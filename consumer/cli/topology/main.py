"""``consumer topology apply|check|migrate`` (also ``python -m topology``): the broker bootstrap."""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import aiormq
from aio_pika.abc import AbstractConnection

from consumer.amqp.connect import (
    BrokerConfig,
    check_broker_supports,
    connect,
    describe_amqp_error,
)
from consumer.cli.topology.migrate import add_migrate_parser, run_migrate
from consumer.cli.topology.migrate_table import run_table_migrate
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, fail, load_handlers, load_queue_table
from consumer.errors import (
    BrokerUnreachable,
    BrokerUnsupported,
    TopologyConflict,
    TopologyError,
    TopologyMissing,
)
from consumer.service.components import broker_config, table_specs
from topology.apply import (
    ExchangeTypeMissing,
    apply_topology,
    find_conflicts,
    missing,
    present_queues,
)
from topology.bindings import compare_bindings, read_bindings
from topology.management import ManagementError, exchange_differences, read_leaders
from topology.model import Topology
from topology.plan import TopologySpec, build_topology

__all__ = ["add_topology_parser", "run_topology"]

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
    add_migrate_parser(actions)


async def _shards_beyond(
    connection: AbstractConnection, specs: Sequence[TopologySpec]
) -> list[str]:
    """A line for each sharded queue the broker has a shard queue beyond the last of: the queue
    was made with more shards, and its hash exchange may still send that shard keys."""
    beyond = {spec.shard_beyond: spec for spec in specs if spec.shard_beyond is not None}
    return [
        f"{name} exists, beyond queue {beyond[name].names.queue}'s shards = "
        f"{beyond[name].shards}: a queue's shard count changes with `consumer topology migrate "
        "--from-queues-file OLD.toml`"
        for name in await present_queues(connection, beyond)
    ]


async def _apply(broker: BrokerConfig, topology: Topology, specs: Sequence[TopologySpec]) -> int:
    connection = await connect(broker, "topology")
    try:
        check_broker_supports(connection, topology)
        beyond = await _shards_beyond(connection, specs)
        if beyond:
            raise TopologyConflict("; ".join(beyond) + ", nothing was changed")
        report = await apply_topology(connection, topology)
    finally:
        await connection.close()
    if report.conflicts:
        raise TopologyConflict(
            "existing topology differs from the plan, nothing was changed: "
            + "; ".join(difference.describe() for difference in report.conflicts)
            + " (`consumer topology migrate` moves an install to a new plan)"
        )
    for line in report.created:
        print(f"created {line}")
    for line in report.unchanged:
        print(f"exists  {line}")
    print(f"bound   {report.bindings} bindings")
    return 0


@dataclass(frozen=True, slots=True)
class _Management:
    """Where ``check`` reads the bindings and the shards' leaders from
    (``CONSUMER_MANAGEMENT_URL``), and the vhost."""

    url: str
    vhost: str


async def _leaders(management: _Management, shards: tuple[str, ...]) -> list[str]:
    """One line per shard queue: the node its leader is on (the management API knows)."""
    if not shards:
        return []
    leaders = await read_leaders(management.url, management.vhost, shards)
    nodes = sorted(set(leaders.values()))
    return [f"shard {queue}: leader on {node}" for queue, node in leaders.items()] + [
        f"shards: {len(shards)} shard queues, leaders on {len(nodes)} node"
        f"{'s' if len(nodes) != 1 else ''} ({', '.join(nodes)})"
    ]


async def _check(
    broker: BrokerConfig,
    topology: Topology,
    management: _Management | None,
    specs: Sequence[TopologySpec] = (),
) -> int:
    shards = tuple(queue for spec in specs if spec.shards > 1 for queue in spec.work_queues)
    connection = await connect(broker, "topology")
    try:
        check_broker_supports(connection, topology)
        lacking = await missing(connection, topology)
        if lacking:
            raise TopologyMissing(
                f"the broker lacks {', '.join(lacking)}: run `consumer topology apply` first"
            )
        differences = [d.describe() for d in await find_conflicts(connection, topology)]
        differences += await _shards_beyond(connection, specs)
    finally:
        await connection.close()
    leaders: list[str] = []
    if management is not None:
        try:
            present = await read_bindings(management.url, management.vhost)
            differences += compare_bindings(topology, present).describe()
            differences += await exchange_differences(
                management.url, management.vhost, topology.exchanges
            )
            leaders = await _leaders(management, shards)
        except ManagementError as error:
            raise TopologyError(f"{error} (CONSUMER_MANAGEMENT_URL)") from None
    elif shards:
        leaders = [
            f"shards: {len(shards)} shard queues; set CONSUMER_MANAGEMENT_URL to see the nodes "
            "their leaders are on"
        ]
    for line in [*differences, *leaders]:
        print(line)
    if differences:
        return 1
    if management is None:
        # AMQP cannot list bindings: say so rather than vouch for them.
        print(
            "topology is in place: exchanges and queues (set CONSUMER_MANAGEMENT_URL to compare "
            "the bindings too)"
        )
    else:
        print("topology is in place: exchanges, queues and bindings")
    return 0


def run_topology(settings: Settings, arguments: argparse.Namespace) -> int:
    if arguments.topology_command == "migrate":
        # From a table, to one, or both: the service without a table is a table of one queue.
        if settings.queues_file is not None or arguments.from_queues_file is not None:
            return run_table_migrate(settings, arguments)
        return run_migrate(settings, arguments)
    registry = load_handlers(settings)
    specs = table_specs(load_queue_table(settings, registry))
    topology = Topology.merge(build_topology(spec) for spec in specs)
    if arguments.topology_command == "apply" and arguments.dry_run:
        for line in topology.describe():
            print(line)
        return 0
    broker = broker_config(settings)
    management = None
    if settings.management_url is not None:
        management = _Management(settings.management_url.get_secret_value(), settings.amqp_vhost)
    try:
        if arguments.topology_command == "apply":
            return asyncio.run(_apply(broker, topology, specs))
        return asyncio.run(_check(broker, topology, management, specs))
    except (BrokerUnsupported, ExchangeTypeMissing) as error:
        fail(str(error), EXIT_CONFIG)
    except (TopologyError, BrokerUnreachable) as error:
        fail(str(error))
    except aiormq.exceptions.ChannelAccessRefused as error:
        fail(f"RabbitMQ refused: {describe_amqp_error(error)} (the bootstrap user needs configure)")
