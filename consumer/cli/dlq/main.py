"""``consumer dlq {list,show,replay,purge}``: the operator's tools for ``<name>.dead``.

Each command streams the queue (:mod:`consumer.cli.dlq.stream`): memory stays bounded whatever the
queue's length, and what is not removed is given back in order when the command ends.
"""

from __future__ import annotations

import argparse
import io
import sys
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import aiormq

from consumer.amqp.connect import connect, describe_amqp_error
from consumer.cli.common import positive_int
from consumer.cli.dlq.commands import DlqCommands
from consumer.cli.dlq.letters import Selection
from consumer.cli.dlq.stream import DEFAULT_STALL
from consumer.config.queue_table import read_queue_table
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, fail
from consumer.durations import parse_duration
from consumer.errors import BrokerUnreachable, ConfigError
from consumer.event_loop import run_event_loop
from consumer.service.components import broker_config, names_for

__all__ = [
    "add_dlq_parser",
    "add_stall_timeout",
    "confirmed",
    "run_dlq",
    "since",
]

EXIT_INTERRUPTED = 130


def since(value: str) -> datetime:
    """``--since 2h`` (that long ago) or ``--since 2026-11-29T10:00:00+00:00``."""
    try:
        return datetime.now(UTC) - parse_duration(value)
    except ValueError:
        pass
    try:
        stamp = datetime.fromisoformat(value)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{value!r} is neither a duration (2h) nor a timestamp"
        ) from None
    return stamp if stamp.tzinfo else stamp.replace(tzinfo=UTC)


def _stall(value: str) -> float:
    try:
        seconds = parse_duration(value).total_seconds()
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{value!r} {error}") from None
    if not seconds > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a duration above 0 (e.g. 5m)")
    return seconds


def add_stall_timeout(parser: argparse.ArgumentParser) -> None:
    """``--stall-timeout``: how long a scan waits with nothing arriving before it gives up."""
    parser.add_argument(
        "--stall-timeout",
        type=_stall,
        default=DEFAULT_STALL,
        metavar="DURATION",
        help="give up, incomplete (exit 1), when nothing at all arrives for this long (default "
        f"{DEFAULT_STALL / 60:g}m); a scan otherwise ends only once every letter the queue held "
        "when it began has arrived",
    )


def _rate(value: str) -> float:
    """``--rate 500`` or ``--rate 500/s``: letters a second."""
    try:
        rate = float(value.removesuffix("/s"))
    except ValueError:
        rate = 0.0
    if not rate > 0:
        raise argparse.ArgumentTypeError(f"{value!r} is not a rate above 0 (e.g. 500/s)")
    return rate


def _add_selection(parser: argparse.ArgumentParser, *, ids: bool = True) -> None:
    if ids:
        parser.add_argument("ids", nargs="*", help="event ids or message ids")
    parser.add_argument("--reason", help="e.g. permanent_failure, retries_exhausted, not_json")
    parser.add_argument("--type", help="event type")
    parser.add_argument("--since", type=since, help="dead-lettered within (2h) or after (ISO time)")
    parser.add_argument(
        "--limit", type=positive_int, help="at most this many matching letters, from the head"
    )


def add_dlq_parser(commands: Any) -> None:
    dlq = commands.add_parser(
        "dlq",
        help="inspect, replay or purge the dead-letter queue",
        description="Every command streams the queue with bounded memory, holds what it reads "
        "unacked and gives it back in order; nothing is removed except by replay or purge.",
    )
    dlq.add_argument(
        "--queue",
        help="the dead-letter queue of this queue of the queue table (CONSUMER_QUEUES_FILE); "
        "replay sends to the ingress exchange, which routes each type to its queue",
    )
    actions = dlq.add_subparsers(dest="dlq_command", required=True)

    list_cmd = actions.add_parser("list", help="list dead letters with counts by reason and type")
    _add_selection(list_cmd, ids=False)
    list_cmd.add_argument("--json", action="store_true", help="one JSON object per line")
    add_stall_timeout(list_cmd)

    show = actions.add_parser("show", help="headers, body and why it failed")
    show.add_argument("id", help="event id or message id")
    add_stall_timeout(show)

    replay_cmd = actions.add_parser(
        "replay", help="send dead letters back to the ingress exchange, attempts reset"
    )
    _add_selection(replay_cmd)
    replay_cmd.add_argument("--all", action="store_true", help="replay every dead letter")
    replay_cmd.add_argument("--dry-run", action="store_true", help="say what would be replayed")
    replay_cmd.add_argument(
        "--rate", type=_rate, help="at most this many letters a second (500 or 500/s)"
    )
    replay_cmd.add_argument(
        "--force",
        action="store_true",
        help="replay expired dead letters too, as new events (occurred_at set to now): applied "
        "even if a copy was applied before; and routing_key_mismatch poison, under its type's "
        "routing key",
    )
    add_stall_timeout(replay_cmd)

    purge = actions.add_parser(
        "purge", help="delete dead letters: every one, or those the filters select"
    )
    _add_selection(purge)
    purge.add_argument("--yes", action="store_true", help="do not ask")
    add_stall_timeout(purge)


def selection_of(arguments: argparse.Namespace) -> Selection:
    return Selection(
        ids=frozenset(getattr(arguments, "ids", None) or ()),
        reason=getattr(arguments, "reason", None),
        type=getattr(arguments, "type", None),
        since=getattr(arguments, "since", None),
        everything=getattr(arguments, "all", False),
    )


def run_dlq(settings: Settings, arguments: argparse.Namespace) -> int:
    selection = selection_of(arguments)
    command = arguments.dlq_command
    if command == "replay" and selection.empty:
        fail("say what to replay: ids, --reason, --type, --since or --all", EXIT_CONFIG)
    queue = _queue_of(settings, arguments.queue)
    dead = names_for(settings, queue).dead
    if isinstance(sys.stdout, io.TextIOWrapper) and not sys.stdout.isatty():
        # A line a letter: into a pipe or a file, one write per line (PYTHONUNBUFFERED) would
        # cost more than reading the letter.
        sys.stdout.reconfigure(line_buffering=False, write_through=False)
    if command == "purge" and not arguments.yes:
        which = "every message" if selection.empty and not arguments.limit else "the selected"
        if not confirmed(f"Delete {which} in {dead}? Type 'yes': "):
            print("nothing deleted")
            return 1
    try:
        return run_event_loop(_run(settings, arguments, selection, queue))
    except KeyboardInterrupt:
        # The summary is printed already; what was not removed is back in the queue.
        return EXIT_INTERRUPTED
    except BrokerUnreachable as error:
        fail(str(error))
    except ConfigError as error:  # an OTEL_* value tracing cannot honour
        fail(str(error), EXIT_CONFIG)
    except aiormq.exceptions.ChannelNotFoundEntity:
        fail(f"{dead} does not exist: run `consumer topology apply`")
    except aiormq.exceptions.ChannelAccessRefused as error:
        fail(f"RabbitMQ refused: {describe_amqp_error(error)}")


def confirmed(question: str) -> bool:
    """Ask on the terminal; only ``yes`` is yes. Without a terminal (a script, a CI job, a pipe)
    there is no one to ask: stop with one line (exit 2) rather than read an answer from a pipe or
    end on EOF, so that deleting needs the explicit ``--yes``."""
    if sys.stdin is None or not sys.stdin.isatty():
        fail(
            "dlq purge asks before deleting and there is no terminal to ask on: add --yes",
            EXIT_CONFIG,
        )
    try:
        answer = input(question)
    except (EOFError, KeyboardInterrupt):
        print()
        return False
    return answer.strip().lower() == "yes"


def _queue_of(settings: Settings, queue: str | None) -> str | None:
    """The table's queue ``--queue`` names (checked against the table), or None."""
    if queue is None:
        return None
    if settings.queues_file is None:
        fail("--queue needs a queue table: set CONSUMER_QUEUES_FILE", EXIT_CONFIG)
    try:
        read_queue_table(settings.queues_file, settings).subset([queue], "--queue")
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    return queue


async def _run(
    settings: Settings, arguments: argparse.Namespace, selection: Selection, queue: str | None
) -> int:
    connection = await connect(broker_config(settings), "dlq")
    try:
        commands = DlqCommands(
            settings,
            connection,
            selection,
            limit=arguments.__dict__.get("limit"),
            stall=arguments.stall_timeout,
            queue=queue,
        )
        command: str = arguments.dlq_command
        chosen: dict[str, Callable[[], Any]] = {
            "list": lambda: commands.list(as_json=arguments.json),
            "show": lambda: commands.show(arguments.id),
            "purge": lambda: commands.purge(),
            "replay": lambda: commands.replay(
                dry_run=arguments.dry_run, force=arguments.force, rate=arguments.rate
            ),
        }
        return int(await chosen[command]())
    finally:
        await connection.close()
