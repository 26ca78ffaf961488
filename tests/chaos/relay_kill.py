"""A chaos-only entry point: the real service (``python -m consumer run``) with its outbox relay's
mark step wrapped so that, once armed, the process SIGKILLs itself after a round's publishes are
confirmed and before they are marked sent: the window the outbox's promise is about (a row
published and confirmed, not yet marked, is published again after the restart under the same
``event_id``, and the consumers' receipts absorb the copy).

Nothing in the product changes: this module replaces the name ``mark_sent`` in
:mod:`consumer.service.outbox_relay`'s namespace, in this process only, then runs the service's
own command line. The runner starts it as the consumers' launcher
(``python -m tests.chaos.relay_kill python -m consumer run``), with two files in the
environment: :data:`ARM` (the runner creates it to arm the next kill; the kill removes it) and
:data:`RECORD` (the kill appends, before it strikes, one JSON line: the ids of the rows confirmed
and left unmarked).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import asyncpg

from consumer.cli.main import main as consumer_main
from consumer.db import outbox_rows
from consumer.service import outbox_relay

ARM = "CHAOS_RELAY_KILL_ARM"
RECORD = "CHAOS_RELAY_KILL_RECORD"


def launcher() -> list[str]:
    """The argv put in front of ``python -m consumer run``."""
    return [sys.executable, "-m", "tests.chaos.relay_kill"]


def kills_recorded(record: Path) -> list[list[int]]:
    """The row ids each kill left confirmed and unmarked, one list per kill."""
    if not record.exists():
        return []
    return [json.loads(line) for line in record.read_text().splitlines() if line.strip()]


def install(arm: Path, record: Path) -> None:
    """Wrap the relay's ``mark_sent``: while ``arm`` exists, the next call with rows records
    them in ``record`` and SIGKILLs the process instead of marking them."""
    real = outbox_rows.mark_sent
    names = vars(outbox_relay)
    if names.get("mark_sent") is not real:
        raise RuntimeError("the outbox relay no longer marks rows through outbox_rows.mark_sent")

    async def mark_or_die(conn: asyncpg.Connection[Any], ids: Iterable[int]) -> None:
        confirmed = list(ids)
        if confirmed and arm.exists():
            # Disarmed first: the process started again must not die at its first round too.
            arm.unlink(missing_ok=True)
            with record.open("a") as out:
                out.write(json.dumps(confirmed) + "\n")
                out.flush()
                os.fsync(out.fileno())
            os.kill(os.getpid(), signal.SIGKILL)
        await real(conn, confirmed)

    names["mark_sent"] = mark_or_die


def main(argv: Sequence[str]) -> int:
    """``argv``: the command to run, ``<python> -m consumer <arguments>``."""
    if list(argv[1:3]) != ["-m", "consumer"]:
        print(f"usage: python -m tests.chaos.relay_kill <python> -m consumer run: {argv}")
        return 2
    install(Path(os.environ[ARM]), Path(os.environ[RECORD]))
    return consumer_main(list(argv[3:]))


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
