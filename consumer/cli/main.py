"""``consumer {run,migrate,topology,publish,dlq,events,outbox,catalogue}``, ``consumer --version``.

``python -m consumer`` is the same command.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import NoReturn
from uuid import UUID, uuid4

import asyncpg

from consumer.amqp import fast_paths, wire
from consumer.amqp.connect import preflight_broker_support
from consumer.cli.pipes import end_by_sigpipe
from consumer.cli.producer import (
    PublishRequest,
    publish_event,
    repeat_command,
    shard_key,
)
from consumer.config.settings import Settings
from consumer.config.startup import (
    EXIT_CONFIG,
    fail,
    load_handlers,
    load_queue_table,
    load_settings,
)
from consumer.db.database import describe_database_error
from consumer.db.migration_sets import MigrationSet, migration_sets
from consumer.db.migrations import create_database_if_missing, migrate
from consumer.errors import (
    BrokerUnreachable,
    ConfigError,
    MigrationError,
    PublishFailed,
)
from consumer.observe.tracing_setup import TracingSetup
from consumer.registry import HandlerRegistry, payload_problem
from consumer.service.app import run
from consumer.service.components import (
    broker_config,
    database_config,
    memory_budget,
    table_topology,
)
from consumer.service.memory import check_queue_budgets
from consumer.version import __version__

__all__ = ["EXIT_SECOND_SIGNAL", "main"]

EXIT_SECOND_SIGNAL = 130


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="consumer",
        description="Apply RabbitMQ events to PostgreSQL exactly once.",
        epilog="Settings come from CONSUMER_* environment variables: docs/operations/settings.md.",
    )
    parser.add_argument("--version", action="version", version=f"rabbit-pg-consumer {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    run_cmd = commands.add_parser("run", help="consume the work queue until SIGTERM or SIGINT")
    run_cmd.add_argument(
        "--queues",
        metavar="A,B",
        help="consume only these queues of the queue table (CONSUMER_QUEUES_FILE): one "
        "deployment per class of work",
    )
    run_cmd.add_argument(
        "--shards",
        metavar="1,3",
        help="consume only these shards of the table's sharded queues, so that replicas split them",
    )

    migrate_cmd = commands.add_parser(
        "migrate",
        help="apply the SQL migrations: the service's, then each handler module's",
        description="Apply the service's migrations, then those of each module in "
        "CONSUMER_HANDLERS that declares a MIGRATIONS folder, in that order.",
    )
    migrate_cmd.add_argument(
        "--create-database",
        action="store_true",
        help="create the database named in CONSUMER_DATABASE_URL if it does not exist",
    )

    publish_cmd = commands.add_parser(
        "publish",
        help="publish one event by hand",
        description="Publish one event to CONSUMER_EXCHANGE, confirmed. Its payload is first "
        "checked against the schema of its type's handler (in CONSUMER_HANDLERS). Prints the "
        "event id, and on stderr the command that publishes the same event again.",
    )
    publish_cmd.add_argument("--type", required=True, help="event type, also the routing key")
    body = publish_cmd.add_mutually_exclusive_group(required=True)
    body.add_argument("--payload", help="the payload as a JSON object")
    body.add_argument("--raw-body", help="send this exact body instead of an envelope")
    publish_cmd.add_argument("--event-id", type=UUID, help="defaults to a new UUID")
    publish_cmd.add_argument(
        "--occurred-at",
        type=_aware_time,
        help="RFC 3339 with an offset; defaults to now. Publishing an event again (a retry) "
        "needs the same --event-id and --occurred-at",
    )
    publish_cmd.add_argument("--correlation-id")
    publish_cmd.add_argument(
        "--no-check",
        action="store_true",
        help="send the payload without checking it against its handler's schema first",
    )

    from consumer.cli.catalogue import add_catalogue_parser
    from consumer.cli.dlq.main import add_dlq_parser
    from consumer.cli.events import add_events_parser
    from consumer.cli.outbox import add_outbox_parser
    from consumer.cli.receipts import add_receipts_parser
    from consumer.cli.topology.main import add_topology_parser

    add_topology_parser(commands)
    add_dlq_parser(commands)
    add_receipts_parser(commands)
    add_events_parser(commands)
    add_outbox_parser(commands)
    add_catalogue_parser(commands)
    return parser


def _aware_time(text: str) -> datetime:
    try:
        stamp = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError("not an RFC 3339 time") from None
    if stamp.tzinfo is None:
        raise argparse.ArgumentTypeError("needs an offset (Z or +01:00)")
    return stamp


def main(argv: Sequence[str] | None = None) -> int:
    try:
        try:
            code = _command(argv)
        finally:
            # Here, not at exit (argparse's --help exits): a reader gone is a closed pipe too.
            sys.stdout.flush()
    except BrokenPipeError:
        end_by_sigpipe()
    return code


def _command(argv: Sequence[str] | None) -> int:
    arguments = _parser().parse_args(argv)
    settings = load_settings()
    if arguments.command == "run":
        return _run(settings, arguments.queues, arguments.shards)
    if arguments.command == "migrate":
        return _migrate_command(settings, create_database=arguments.create_database)
    if arguments.command == "publish":
        return asyncio.run(_publish(settings, arguments))
    if arguments.command == "topology":
        from consumer.cli.topology.main import run_topology

        return run_topology(settings, arguments)
    if arguments.command == "receipts":
        from consumer.cli.receipts import run_receipts

        return run_receipts(settings, arguments)
    if arguments.command == "events":
        from consumer.cli.events import run_events

        return run_events(settings, arguments)
    if arguments.command == "outbox":
        from consumer.cli.outbox import run_outbox

        return run_outbox(settings, arguments)
    if arguments.command == "catalogue":
        from consumer.cli import catalogue

        return catalogue.run(settings, arguments)
    from consumer.cli.dlq.main import run_dlq

    return run_dlq(settings, arguments)


# -- run ----------------------------------------------------------------------------------------


def _run(settings: Settings, queues: str | None, shards: str | None = None) -> int:
    registry = load_handlers(settings)
    table = load_queue_table(settings, registry)
    if queues is not None:
        if table.path is None:
            fail("--queues needs a queue table: set CONSUMER_QUEUES_FILE", EXIT_CONFIG)
        try:
            table = table.subset([name.strip() for name in queues.split(",") if name.strip()])
        except ConfigError as error:
            fail(str(error), EXIT_CONFIG)
    if shards is not None:
        if table.path is None:
            fail("--shards needs a queue table: set CONSUMER_QUEUES_FILE", EXIT_CONFIG)
        try:
            table = table.shard_subset(_shard_numbers(shards))
        except ConfigError as error:
            fail(str(error), EXIT_CONFIG)
    try:
        check_queue_budgets(
            {
                queue.label: memory_budget(queue.settings, len(queue.consumed_shards))
                for queue in table.queues
            }
        )
        # The header limits hold only if pamqp reads tables through the decoders installed in
        # its place: checked once, before any connection (consumer.amqp.wire).
        broker = broker_config(settings)
        fast_paths.install(fast_path=broker.fast_path, header_limits=broker.header_limits)
        wire.self_test(broker.header_limits)
        asyncio.run(preflight_broker_support(broker, table_topology(table)))
        table.check_shared_waits()
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    return run(settings, registry, table)


def _shard_numbers(text: str) -> list[int]:
    """``--shards 1,3``: the shard numbers, or one line saying what is not one."""
    parts = [part.strip() for part in text.split(",") if part.strip()]
    wrong = [part for part in parts if not (part.isascii() and part.isdigit())]
    if wrong:
        fail(f"--shards: {', '.join(map(repr, wrong))} is no shard number (1, 2, ...)", EXIT_CONFIG)
    return [int(part) for part in parts]


# -- migrate ------------------------------------------------------------------------------------


def _migrate_command(settings: Settings, *, create_database: bool) -> int:
    try:
        sets = migration_sets(settings.handlers)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    return asyncio.run(_migrate(settings, sets, create_database=create_database))


async def _migrate(settings: Settings, sets: list[MigrationSet], *, create_database: bool) -> int:
    database = database_config(settings)
    dsn, connect = database.dsn, database.connector()
    try:
        if create_database:
            name = database.database_name
            admin = await connect(dsn, database="postgres")
            try:
                if await create_database_if_missing(admin, name):
                    print(f"created database {name}")
            finally:
                await admin.close()
        conn = await connect(dsn)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
        fail(f"cannot connect to {settings.safe_database_url}: {describe_database_error(error)}")
    try:
        report = await migrate(conn, sets)
    except MigrationError as error:
        fail(str(error))
    except asyncpg.PostgresError as error:
        fail(f"migration failed: {describe_database_error(error)}")
    finally:
        await conn.close()
    for label in report.recorded:
        print(f"recorded {label} (applied under the old ledger, schema_migrations)")
    for label in report.applied:
        print(f"applied {label}")
    if not report.recorded and not report.applied:
        print("database is up to date")
    return 0


# -- publish ------------------------------------------------------------------------------------


def _handlers_if_loadable(settings: Settings) -> HandlerRegistry | None:
    """The handlers, for the shard key alone: ``--no-check`` publishes without them too."""
    try:
        return HandlerRegistry.from_modules(settings.handlers)
    except Exception:
        # Whatever a module raises at import (not only ConfigError): --no-check sends anyway,
        # by the event id, as it did before it read the handlers at all.
        return None


def _no_constant(name: str) -> NoReturn:
    # JSON has no NaN nor infinity (json.loads takes them): the envelope could not carry them.
    raise ValueError(f"{name} is no JSON value")


async def _publish(settings: Settings, arguments: argparse.Namespace) -> int:
    registry: HandlerRegistry | None = None
    if arguments.payload is not None:
        try:
            payload = json.loads(arguments.payload, parse_constant=_no_constant)
        except ValueError as error:
            fail(f"--payload is not JSON: {error}", EXIT_CONFIG)
        if not isinstance(payload, dict):
            fail("--payload must be a JSON object", EXIT_CONFIG)
        if arguments.no_check:
            registry = _handlers_if_loadable(settings)
        else:
            registry = load_handlers(settings)
            problem = payload_problem(registry, arguments.type, payload)
            if problem is not None:
                fail(f"{problem} (--no-check sends it anyway)", EXIT_CONFIG)
    # Fixed here, not at the envelope: the command that repeats the event needs it.
    occurred_at = arguments.occurred_at or datetime.now(UTC)
    request = PublishRequest(
        event_type=arguments.type,
        payload=payload if arguments.payload is not None else None,
        raw_body=arguments.raw_body.encode() if arguments.raw_body is not None else None,
        event_id=arguments.event_id or uuid4(),
        correlation_id=arguments.correlation_id,
        occurred_at=occurred_at,
        shard_key=shard_key(registry, arguments.type, payload)
        if arguments.payload is not None
        else None,
    )
    try:
        tracing = TracingSetup.from_environment(settings.name)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    try:
        async with tracing as tracer:
            event_id = await publish_event(
                broker_config(settings), settings.exchange, request, tracing=tracer
            )
    except (BrokerUnreachable, ConfigError, PublishFailed) as error:
        fail(str(error))
    print(event_id)
    print(f"to publish it again: {repeat_command(request, event_id, occurred_at)}", file=sys.stderr)
    return 0
