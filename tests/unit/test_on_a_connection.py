"""``on_a_connection``: the one skeleton every transaction of the pipeline runs in, sorting what
goes wrong three ways (a lost connection, what no event can be blamed for, this work's failure)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any, cast

import pytest

from consumer.db.database import Database
from consumer.errors import ConfigError, DatabaseUnavailable, PipelineFault
from consumer.pipeline.judge import on_a_connection


class _Connection:
    def __init__(self) -> None:
        self.closed = False

    def is_closed(self) -> bool:
        return self.closed


class _Database:
    def __init__(self, refuse: Exception | None = None) -> None:
        self.conn = _Connection()
        self._refuse = refuse

    @asynccontextmanager
    async def connection(self) -> AsyncIterator[_Connection]:
        if self._refuse is not None:
            raise self._refuse
        yield self.conn


def _failed(error: Exception) -> tuple[str, Exception]:
    return ("failed", error)


async def _run(database: _Database, work: Any) -> Any:
    return await on_a_connection(cast(Database, database), work, failed=_failed)


async def test_what_the_work_returns_is_the_verdict() -> None:
    async def work(conn: Any) -> str:
        return "applied"

    assert await _run(_Database(), work) == "applied"


async def test_an_error_on_a_live_connection_is_the_works_failure() -> None:
    async def work(conn: Any) -> str:
        raise ValueError("the handler's bug")

    verdict, error = await _run(_Database(), work)

    assert verdict == "failed"
    assert isinstance(error, ValueError)


async def test_an_error_on_a_lost_connection_is_the_database_unavailable() -> None:
    database = _Database()

    async def work(conn: Any) -> str:
        conn.closed = True  # the handler's error hides that the connection went
        raise KeyError("whatever the handler made of it")

    verdict, error = await _run(database, work)

    assert verdict == "failed"
    assert isinstance(error, DatabaseUnavailable)
    assert isinstance(error.__cause__, KeyError)


@pytest.mark.parametrize("fault", [ConfigError("bad setting"), PipelineFault("no workers")])
async def test_what_no_event_can_be_blamed_for_goes_on_up(fault: Exception) -> None:
    async def work(conn: Any) -> str:
        raise fault

    with pytest.raises(type(fault)):
        await _run(_Database(), work)


async def test_a_pool_that_cannot_give_a_connection_is_the_works_failure() -> None:
    refused = DatabaseUnavailable("no connection")

    async def work(conn: Any) -> str:
        raise AssertionError("never runs")

    assert await _run(_Database(refuse=refused), work) == ("failed", refused)
