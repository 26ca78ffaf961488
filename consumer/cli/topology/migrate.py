"""``consumer topology migrate``: move an install from the plan its old settings gave to the one
the environment's settings give, while the consumers keep running.

The environment holds the new settings (as the new replicas will get them); ``--from-*`` say what
the old ones were, for the settings a migration may change: the retry ladder, the delivery limit
and the work queue's generation. ``--rollback`` migrates back, from the new plan to the old.
With a queue table on either side, ``--from-queues-file`` names the old table (``none``: there was
none) and ``CONSUMER_QUEUES_FILE`` the new one (unset: there is none)
(:mod:`consumer.cli.topology.migrate_table`).
"""

from __future__ import annotations

import argparse
import asyncio
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Protocol

import aiormq
from aio_pika.abc import AbstractIncomingMessage
from pydantic import ValidationError

from consumer.amqp import headers as h
from consumer.amqp.connect import (
    BrokerConfig,
    check_broker_supports,
    connect,
    describe_amqp_error,
)
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, fail, load_handlers
from consumer.durations import parse_duration
from consumer.errors import BrokerUnreachable, BrokerUnsupported
from consumer.service.components import broker_config, topology_spec
from topology.migrate import MigrationConflict, MigrationReport, StepResult, run_migration
from topology.migration_plan import MigrationRefused, plan_migration
from topology.model import Topology
from topology.mover import HeaderRewrite, MoveFailed
from topology.names import Names
from topology.plan import build_topology
from topology.steps import MigrationPlan

__all__ = [
    "EXIT_PENDING",
    "Steps",
    "add_migrate_parser",
    "answered_offline",
    "carry_out",
    "from_flags",
    "moved_headers",
    "run_migrate",
]

EXIT_PENDING = 75
"""EX_TEMPFAIL: the migration went as far as it can for now; run it again later."""

# Flag -> the setting it gives the old value of.
_FROM = {
    "from_retry_delays": "retry_delays",
    "from_delivery_limit": "delivery_limit",
    "from_work_queue_version": "work_queue_version",
    "from_ack_timeout": "ack_timeout",
}

_UNSET = "none"
"""``--from-ack-timeout none``: the old work queue had no timeout of its own."""


def add_migrate_parser(actions: Any) -> None:
    """``migrate`` as an action of ``consumer topology``."""
    migrate = actions.add_parser(
        "migrate",
        help="move to the plan of the current settings from the one of the --from settings",
        description="Move an install from the plan of its old settings (--from-*) to the plan "
        "of the current ones, while the consumers run, losing no message.",
    )
    migrate.add_argument("--from-retry-delays", metavar="DELAYS", help="the old ladder")
    migrate.add_argument("--from-delivery-limit", metavar="N", help="the old delivery limit")
    migrate.add_argument(
        "--from-work-queue-version", metavar="N", help="the old CONSUMER_WORK_QUEUE_VERSION"
    )
    migrate.add_argument(
        "--from-ack-timeout",
        metavar="DURATION|none",
        help="the old CONSUMER_ACK_TIMEOUT (none: it was unset)",
    )
    migrate.add_argument(
        "--from-queues-file",
        metavar="PATH|none",
        help="the old queue table (CONSUMER_QUEUES_FILE names the new one; unset, the install "
        "goes back to no table): moves event types between queues, adds and removes queues, and "
        "changes each queue's own settings; it is read with today's environment, so write in it "
        "any setting whose environment value changed since. none: the install had no table (the "
        "other --from-* flags may then give its old settings)",
    )
    migrate.add_argument(
        "--dry-run", action="store_true", help="print the steps; do not connect to the broker"
    )
    migrate.add_argument(
        "--rollback", action="store_true", help="migrate back, from the new plan to the old"
    )
    migrate.add_argument(
        "--wait",
        type=parse_duration,
        default=parse_duration("0s"),
        metavar="DURATION",
        help="how long to wait for the old work queue's last consumers to go (default 0s)",
    )


def from_flags(arguments: argparse.Namespace) -> list[str]:
    """The ``--from-*`` settings flags given (not ``--from-queues-file``)."""
    return ["--" + flag.replace("_", "-") for flag in _FROM if getattr(arguments, flag) is not None]


def old_settings(settings: Settings, arguments: argparse.Namespace) -> Settings:
    """The settings the install was set up with: the current ones, with the ``--from-*``."""
    changes = {
        field: None if getattr(arguments, flag) == _UNSET else getattr(arguments, flag)
        for flag, field in _FROM.items()
        if getattr(arguments, flag) is not None
    }
    try:
        return Settings.model_validate({**settings.model_dump(), **changes})
    except ValidationError as error:
        problems = [
            f"--from-{str(detail['loc'][0]).replace('_', '-')}: "
            + detail["msg"].removeprefix("Value error, ")
            for detail in error.errors(include_url=False)
        ]
        fail("invalid " + "; ".join(problems), EXIT_CONFIG)


def moved_headers(*names: Names) -> HeaderRewrite:
    """The headers of a copy moved out of a work queue: it goes through the service's own
    redeliver exchange, which the service trusts, so it keeps only what the service would have
    trusted in the original (its own headers if the original came back from the ladder of one
    of ``names``, none of a producer's), and the exchange and routing key it was first published
    to."""
    redelivers = {each.redeliver for each in names}

    def rewrite(message: AbstractIncomingMessage) -> dict[str, Any]:
        own = message.exchange in redelivers
        copy = h.trusted_headers(dict(message.headers or {}), trusted=own)
        if not own:
            copy.setdefault(h.ORIGINAL_EXCHANGE, message.exchange or "")
            copy.setdefault(h.ORIGINAL_ROUTING_KEY, message.routing_key or "")
        return copy

    return rewrite


def _print_step(number: int, result: StepResult) -> None:
    print(f"{number:>2}. {result.step.describe()}: {result.outcome}", flush=True)


async def _migrate(
    broker: BrokerConfig,
    plan: MigrationPlan,
    rewrite: HeaderRewrite,
    wait: float,
    targets: Sequence[Topology],
) -> MigrationReport:
    connection = await connect(broker, "topology")
    try:
        for target in targets:
            check_broker_supports(connection, target)
        return await run_migration(
            connection,
            plan,
            rewrite_work_headers=rewrite,
            confirm_timeout=broker.publish_timeout,
            wait=wait,
            on_step=_print_step,
        )
    finally:
        await connection.close()


def carry_out(
    settings: Settings,
    plan: MigrationPlan,
    rewrite: HeaderRewrite,
    wait: timedelta,
    targets: Sequence[Topology],
) -> bool:
    """Run ``plan``'s steps on the broker, printing each; false when one must wait (it printed
    why: the caller exits :data:`EXIT_PENDING`). ``targets``, the plans migrated to, are first
    checked against the broker's version (a refusal exits with its one line, nothing done). A
    failure exits with its one line."""
    try:
        report = asyncio.run(
            _migrate(broker_config(settings), plan, rewrite, wait.total_seconds(), targets)
        )
    except BrokerUnsupported as error:
        fail(str(error), EXIT_CONFIG)
    except MigrationConflict as error:
        fail(f"{error}: nothing past this step was done")
    except MoveFailed as error:
        fail(f"{error}: run the migration again to resume it")
    except BrokerUnreachable as error:
        fail(str(error))
    except aiormq.exceptions.ChannelAccessRefused as error:
        fail(f"RabbitMQ refused: {describe_amqp_error(error)} (run it as the bootstrap user)")
    except (aiormq.exceptions.AMQPError, ConnectionError, TimeoutError) as error:
        fail(f"lost RabbitMQ: {describe_amqp_error(error)}: run the migration again to resume it")
    if report.pending is not None:
        print(f"pending: {report.pending}", flush=True)
        return False
    return True


class Steps(Protocol):
    """A migration's steps, as a :class:`MigrationPlan` or a queue table's migration has them."""

    @property
    def changes_nothing(self) -> bool: ...

    def describe(self) -> list[str]: ...


def answered_offline(steps: Steps, *, dry_run: bool) -> bool:
    """Print what needs no broker (nothing to migrate, or with ``dry_run`` the steps); true when
    that was all."""
    if steps.changes_nothing:
        print("nothing to migrate: the two plans are the same")
        return True
    if dry_run:
        for line in steps.describe():
            print(line)
        return True
    return False


def run_migrate(settings: Settings, arguments: argparse.Namespace) -> int:
    registry = load_handlers(settings)
    old, new = old_settings(settings, arguments), settings
    if arguments.rollback:
        old, new = new, old
    try:
        plan = plan_migration(topology_spec(old, registry), topology_spec(new, registry))
    except MigrationRefused as error:
        fail(str(error), EXIT_CONFIG)
    if answered_offline(plan, dry_run=arguments.dry_run):
        return 0
    target = topology_spec(new, registry)
    names = target.names
    if not carry_out(
        settings, plan, moved_headers(names), arguments.wait, [build_topology(target)]
    ):
        return EXIT_PENDING
    print(f"migrated: {names.work} is the work queue")
    return 0
