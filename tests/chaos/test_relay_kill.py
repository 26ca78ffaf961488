"""The chaos-only entry point that SIGKILLs the relay between a confirm and the mark: unarmed it
marks as the relay does; armed, it records the confirmed rows and kills its process instead of
marking them, once."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from consumer.db import outbox_rows
from consumer.service import outbox_relay
from tests.chaos import relay_kill


class FakeConnection:
    def __init__(self) -> None:
        self.marked: list[list[int]] = []

    async def execute(self, _query: str, ids: list[int]) -> None:
        self.marked.append(ids)


def test_an_armed_relay_records_its_confirmed_rows_and_kills_its_process_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Given the relay's mark wrapped (put back after the test), and a kill that only records
    monkeypatch.setitem(vars(outbox_relay), "mark_sent", outbox_rows.mark_sent)
    killed: list[tuple[int, int]] = []
    monkeypatch.setattr(os, "kill", lambda pid, sig: killed.append((pid, sig)))
    arm, record = tmp_path / "arm", tmp_path / "killed.jsonl"
    relay_kill.install(arm, record)
    conn: Any = FakeConnection()
    mark = vars(outbox_relay)["mark_sent"]

    # When it marks unarmed, then armed, then again
    asyncio.run(mark(conn, [1, 2]))
    arm.touch()
    asyncio.run(mark(conn, []))  # a round with nothing confirmed does not use the arming
    asyncio.run(mark(conn, [3, 4]))
    asyncio.run(mark(conn, [5]))

    # Then only the armed round's rows are recorded, its process killed, and the arming spent
    assert relay_kill.kills_recorded(record) == [[3, 4]]
    assert killed == [(os.getpid(), signal.SIGKILL)]
    assert not arm.exists()
    # (the fake kill returns, so the armed round is marked after it too)
    assert conn.marked == [[1, 2], [], [3, 4], [5]]


def test_the_entry_point_runs_only_the_consumer_command() -> None:
    assert relay_kill.main(["python", "-m", "somethingelse", "run"]) == 2
