"""The dead-letter commands themselves, each one pass over the queue with bounded memory."""

from __future__ import annotations

import sys
from contextlib import AsyncExitStack

from aio_pika.abc import AbstractConnection

from consumer.amqp.connect import connect
from consumer.cli.dlq.letters import DeadMessage, Selection, read_dead_letter
from consumer.cli.dlq.output import (
    Counts,
    letter_json,
    letter_row,
    progress_bar,
    show_letter,
    shown,
)
from consumer.cli.dlq.replay import ReplayOptions, Tally, replay
from consumer.cli.dlq.replay_sender import ReplaySender
from consumer.cli.dlq.stream import DEFAULT_STALL, Held, QueueScan
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_FAILURE, load_handlers
from consumer.observe.tracing_setup import TracingSetup
from consumer.pipeline.envelope_parser import EnvelopeParser
from consumer.service.components import broker_config, envelope_limits, names_for

__all__ = ["DlqCommands"]


class DlqCommands:
    """``list``, ``show``, ``replay`` and ``purge`` on one service's dead-letter queue (with
    ``queue``, that queue of its queue table's)."""

    def __init__(
        self,
        settings: Settings,
        connection: AbstractConnection,
        selection: Selection,
        *,
        limit: int | None,
        stall: float = DEFAULT_STALL,
        queue: str | None = None,
    ) -> None:
        self._settings = settings
        self._stall = stall
        self._connection = connection
        self._selection = selection
        self._limit = limit
        self._queue = names_for(settings, queue).dead
        self._registry = load_handlers(settings)
        self._parser = EnvelopeParser(envelope_limits(settings))
        self._read = 0

    def _letter(self, held: Held, *, validate: bool = True) -> DeadMessage:
        self._read += 1
        return read_dead_letter(
            held.message,
            self._read - 1,
            registry=self._registry,
            parser=self._parser,
            validate=validate,
        )

    def _letter_to_replay(self, held: Held) -> DeadMessage:
        # The body is sent on as it is: its payload is validated only if the reason needs it.
        return self._letter(held, validate=False)

    def _scan(self) -> QueueScan:
        return QueueScan(self._connection, queue=self._queue, stall=self._stall)

    def _end(self, scan: QueueScan, code: int = 0) -> int:
        """``code``, unless the scan ended before reading what the queue held: then it says so
        on stderr and fails."""
        if scan.shortfall is None:
            return code
        print(
            f"error: incomplete: read {scan.read} of the {scan.present} letters {self._queue} "
            f"held when the command began: {scan.shortfall} (another client took or purged "
            "some, or the broker stopped sending; --stall-timeout waits longer)",
            file=sys.stderr,
        )
        return EXIT_FAILURE

    async def list(self, *, as_json: bool) -> int:
        counts = Counts()
        async with self._scan() as scan:
            async for held in scan.messages():
                letter = self._letter(held)
                if not self._selection.matches(letter):
                    continue
                counts.add(letter)
                print(letter_json(letter) if as_json else letter_row(letter))
                if self._limit is not None and counts.total >= self._limit:
                    break
            present = scan.present
        if not as_json:
            for line in counts.lines(self._read):
                print(line)
            if self._read < present and not scan.incomplete:
                print(f"read {self._read} of the {present} in the queue (--limit)")
        return self._end(scan)

    async def show(self, ident: str) -> int:
        found = 0
        async with self._scan() as scan:
            async for held in scan.messages():
                letter = self._letter(held)
                if ident in (letter.id, letter.event_id, letter.message_id):
                    found += 1
                    show_letter(letter)
        if not found:
            print(f"no dead letter with id {shown(ident)}", file=sys.stderr)
            return EXIT_FAILURE
        return self._end(scan)

    async def purge(self) -> int:
        async with self._scan() as scan:
            if self._selection.empty and self._limit is None:
                result = await scan.purge_ready()
                print(f"purged {result} messages from {self._queue}")
                return 0
            purged = 0
            bar = progress_bar(scan.present, "purge")
            try:
                async for held in scan.messages():
                    bar.update()
                    if not self._selection.matches(self._letter(held)):
                        continue
                    await scan.take(held)
                    purged += 1
                    if self._limit is not None and purged >= self._limit:
                        break
            finally:
                bar.close()
                # Printed however the purge ended: what it says is gone is gone.
                print(
                    f"purged {purged} of {self._read} read from {self._queue}; the others stay, "
                    "in order"
                )
        return self._end(scan)

    async def replay(self, *, dry_run: bool, force: bool, rate: float | None) -> int:
        if dry_run:
            return await self._dry_run(force=force)
        exchange = self._settings.exchange
        options = ReplayOptions(exchange=exchange, force=force, limit=self._limit, rate=rate)
        tally = Tally()
        # Published on a connection of its own: a broker's memory alarm blocks a connection
        # that publishes, and the acks of the dead copies must still get through.
        publishing = await connect(broker_config(self._settings), "dlq-replay")
        stack = AsyncExitStack()
        try:
            channel = await publishing.channel(publisher_confirms=True, on_return_raises=True)
            # Each replay carries on the dead letter's trace (consumer.pipeline.tracing).
            tracing = await stack.enter_async_context(
                TracingSetup.from_environment(self._settings.name)
            )
            sender = ReplaySender(
                await channel.get_underlay_channel(),
                confirm_within=self._settings.publish_timeout,
                tracing=tracing,
            )
            async with self._scan() as scan:
                bar = progress_bar(scan.present, "replay")
                try:
                    await replay(
                        scan,
                        self._letter_to_replay,
                        self._selection,
                        sender,
                        options,
                        tally,
                        _report,
                        progress=bar.update,
                    )
                finally:
                    bar.close()
                    # However the replay ended (Ctrl-C, the broker gone): what it did.
                    for line in tally.lines():
                        print(line)
        finally:
            await stack.aclose()
            await publishing.close()
        code = 0 if not (tally.kept or tally.failed or tally.not_removed) else EXIT_FAILURE
        return self._end(scan, code)

    async def _dry_run(self, *, force: bool) -> int:
        chosen = 0
        async with self._scan() as scan:
            async for held in scan.messages():
                letter = self._letter(held)
                if not self._selection.matches(letter):
                    continue
                chosen += 1
                refusal = letter.refusal(force=force)
                if refusal is not None:
                    print(f"would keep   {shown(letter.id)}: {refusal}")
                else:
                    print(
                        f"would replay {shown(letter.id)} -> {self._settings.exchange} "
                        f"{shown(letter.type)} ({shown(letter.reason)})"
                    )
                if self._limit is not None and chosen >= self._limit:
                    break
        print(f"{chosen} of {self._read} would be replayed")
        return self._end(scan)


def _report(letter: DeadMessage, problem: str | None) -> None:
    if problem is None:
        print(f"replayed {shown(letter.id)} -> {shown(letter.type)}")
    else:
        print(f"kept     {shown(letter.id)}: {shown(problem)}", file=sys.stderr)
