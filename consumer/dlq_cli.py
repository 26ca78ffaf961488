"""``consumer dlq {list,show,replay,purge}``: the operator's tools for ``<name>.dead``."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from datetime import UTC, datetime
from typing import Any

import aiormq

from consumer.amqp import connect, describe_amqp_error
from consumer.config import broker_config, envelope_limits, names_for
from consumer.dlq import (
    REFUSED_EXPIRED,
    DeadLetterQueue,
    DeadMessage,
    Selection,
    counts,
    replay,
)
from consumer.durations import parse_duration
from consumer.envelope import EnvelopeParser, one_line
from consumer.errors import BrokerUnreachable, ConfigError
from consumer.publisher import Publisher
from consumer.settings import Settings
from consumer.startup import EXIT_CONFIG, fail, load_handlers
from consumer.tracing import TracingSetup

__all__ = ["add_dlq_parser", "confirmed", "run_dlq", "shown"]


def _since(value: str) -> datetime:
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


def _add_filters(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--reason", help="e.g. permanent_failure, retries_exhausted, not_json")
    parser.add_argument("--type", help="event type")
    parser.add_argument(
        "--since", type=_since, help="dead-lettered within (2h) or after (ISO time)"
    )


def add_dlq_parser(commands: Any) -> None:
    dlq = commands.add_parser(
        "dlq",
        help="inspect, replay or purge the dead-letter queue",
        description="Browsing holds the messages unacked and returns them in order; nothing is "
        "removed except by replay or purge.",
    )
    actions = dlq.add_subparsers(dest="dlq_command", required=True)

    list_cmd = actions.add_parser("list", help="list dead letters with counts by reason and type")
    _add_filters(list_cmd)
    list_cmd.add_argument("--json", action="store_true", help="one JSON object per line")

    show = actions.add_parser("show", help="headers, body and why it failed")
    show.add_argument("id", help="event id or message id")

    replay_cmd = actions.add_parser(
        "replay", help="send dead letters back to the ingress exchange, attempts reset"
    )
    replay_cmd.add_argument("ids", nargs="*", help="event ids or message ids")
    _add_filters(replay_cmd)
    replay_cmd.add_argument("--all", action="store_true", help="replay every dead letter")
    replay_cmd.add_argument("--dry-run", action="store_true", help="say what would be replayed")
    replay_cmd.add_argument(
        "--force",
        action="store_true",
        help="replay expired dead letters too, as new events (occurred_at set to now): applied "
        "even if a copy was applied before",
    )

    purge = actions.add_parser("purge", help="delete every dead letter")
    purge.add_argument("--yes", action="store_true", help="do not ask")


def _selection(arguments: argparse.Namespace) -> Selection:
    return Selection(
        ids=frozenset(getattr(arguments, "ids", None) or ()),
        reason=arguments.reason,
        type=arguments.type,
        since=arguments.since,
        everything=getattr(arguments, "all", False),
    )


def run_dlq(settings: Settings, arguments: argparse.Namespace) -> int:
    if arguments.dlq_command == "replay" and _selection(arguments).empty:
        fail("say what to replay: ids, --reason, --type, --since or --all", EXIT_CONFIG)
    question = f"Delete every message in {names_for(settings).dead}? Type 'yes': "
    if arguments.dlq_command == "purge" and not arguments.yes and not confirmed(question):
        print("nothing deleted")
        return 1
    try:
        return asyncio.run(_run(settings, arguments))
    except BrokerUnreachable as error:
        fail(str(error))
    except ConfigError as error:  # an OTEL_* value tracing cannot honour
        fail(str(error), EXIT_CONFIG)
    except aiormq.exceptions.ChannelNotFoundEntity:
        fail(f"{names_for(settings).dead} does not exist: run `consumer topology apply`")
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


async def _run(settings: Settings, arguments: argparse.Namespace) -> int:
    registry = load_handlers(settings)
    names = names_for(settings)
    connection = await connect(broker_config(settings), "dlq")
    try:
        async with DeadLetterQueue(
            connection,
            queue=names.dead,
            registry=registry,
            parser=EnvelopeParser(envelope_limits(settings)),
        ) as dead:
            command = arguments.dlq_command
            if command == "purge":
                print(f"purged {await dead.purge()} messages from {names.dead}")
                return 0
            letters = await dead.read()
            if command == "list":
                return _list(letters, _selection(arguments), as_json=arguments.json)
            if command == "show":
                return _show(letters, arguments.id)
            chosen = [letter for letter in letters if _selection(arguments).matches(letter)]
            if arguments.dry_run:
                for letter in chosen:
                    if letter.expired and not arguments.force:
                        print(f"would keep   {shown(letter.id)}: {REFUSED_EXPIRED}")
                        continue
                    print(
                        f"would replay {shown(letter.id)} -> {settings.exchange} "
                        f"{shown(letter.type)} ({shown(letter.reason)})"
                    )
                print(f"{len(chosen)} of {len(letters)} would be replayed")
                return 0
            channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
            # Each replay carries on the dead letter's trace (consumer.tracing).
            async with TracingSetup.from_environment(settings.name) as tracing:
                publisher = await Publisher.on(
                    channel, confirm_within=settings.publish_timeout, tracing=tracing
                )
                result = await replay(
                    dead, chosen, publisher, exchange=settings.exchange, force=arguments.force
                )
            for letter in result.replayed:
                print(f"replayed {shown(letter.id)} -> {shown(letter.type)}")
            for letter, error in result.failed:
                print(f"kept     {shown(letter.id)}: {shown(error)}", file=sys.stderr)
            print(
                f"replayed {len(result.replayed)}, kept {len(result.failed)} (a failed publish, "
                "no valid envelope, or expired without --force)"
            )
            return 0 if not result.failed else 1
    finally:
        await connection.close()


def shown(value: object, limit: int = 200) -> str:
    """``value`` fit for a terminal: control characters and bidirectional overrides escaped (a
    producer wrote most of what a dead letter says), on one line, at most ``limit`` characters."""
    if value is None:
        return "?"
    if isinstance(value, bytes | bytearray):
        value = bytes(value).decode("utf-8", errors="backslashreplace")
    return one_line(str(value), limit)


def _list(letters: list[DeadMessage], selection: Selection, *, as_json: bool) -> int:
    chosen = [letter for letter in letters if selection.matches(letter)]
    if as_json:
        for letter in chosen:
            print(json.dumps(letter.summary()))
        return 0
    for letter in chosen:
        row = letter.summary()
        print(
            f"{shown(row['id'], 64):<36}  {shown(row['type'], 64):<24}  "
            f"{shown(row['reason'], 32):<18}  attempts={row['attempts']}  "
            f"at={row['dead_lettered_at'] or '?'}  "
            f"{shown(row['error_class'] or '', 80)} {shown(row['error'] or '', 80)}"
        )
    by_reason, by_type = counts(chosen)
    print(f"{len(chosen)} dead letters (of {len(letters)} in the queue)")
    print(
        "by reason: "
        + (", ".join(f"{shown(k, 32)}={v}" for k, v in by_reason.most_common()) or "-")
    )
    print(
        "by type:   " + (", ".join(f"{shown(k, 64)}={v}" for k, v in by_type.most_common()) or "-")
    )
    return 0


def _show(letters: list[DeadMessage], ident: str) -> int:
    matches = [
        letter for letter in letters if ident in (letter.id, letter.event_id, letter.message_id)
    ]
    if not matches:
        print(f"no dead letter with id {shown(ident)}", file=sys.stderr)
        return 1
    for letter in matches:
        # Whatever the producer wrote is marked so, and escaped: it is not the service speaking.
        print(f"id:              {shown(letter.id)}  (from the producer)")
        print(f"type:            {shown(letter.type)}  (from the producer)")
        print(f"reason:          {shown(letter.reason)}")
        print(f"attempts:        {letter.attempts}")
        print(f"dead-lettered:   {letter.dead_lettered_at or '?'}")
        print(
            f"original:        {shown(letter.original_exchange)} "
            f"{shown(letter.original_routing_key)}"
        )
        error = f"{shown(letter.error_class or '')} {shown(letter.error_message or '', 500)}"
        print(f"error:           {error.rstrip()}")
        if letter.poison_detail:
            print(f"parse error:     {shown(letter.poison_detail, 500)}")
        print(f"browsed:         {letter.deliveries} times")
        own = {k: v for k, v in letter.headers.items() if _set_by_us(k)}
        theirs = {k: v for k, v in letter.headers.items() if not _set_by_us(k)}
        print("headers set by the service and the broker:")
        for key, value in sorted(own.items()):
            print(f"  {shown(key, 64)}: {shown(value, 500)}")
        print("headers set by the producer:")
        for key, value in sorted(theirs.items()):
            print(f"  {shown(key, 64)}: {shown(value, 500)}")
        print("body (from the producer):")
        print("  " + shown(letter.body, 4000))
    return 0


def _set_by_us(header: str) -> bool:
    return header.startswith(("consumer-", "x-"))
