"""The workers' tasks: one that ends by itself ends the service, however it ended."""

from __future__ import annotations

import asyncio
from typing import Any, cast

from consumer.errors import PipelineFault
from consumer.service.worker_tasks import WorkerTasks


class Workers:
    """Workers that wait until told to end the way a library's error ends them."""

    def __init__(self) -> None:
        self.cut_off = asyncio.Event()

    async def worker(self, _: object) -> None:
        await self.cut_off.wait()
        # What a worker settling a copy gets when aiormq closes a connection whose heartbeat ran
        # out: the publish's confirm fails with the CancelledError that stopped aiormq's reader.
        raise asyncio.CancelledError

    async def isolated(self) -> None:
        await asyncio.Event().wait()


class Beat:
    async def keep(self) -> None:
        await asyncio.Event().wait()


class Log:
    def __init__(self) -> None:
        self.errors: list[str] = []

    def error(self, event: str, **_: Any) -> None:
        self.errors.append(event)


def tasks_of(workers: Workers, log: Log) -> WorkerTasks:
    return WorkerTasks(
        workers=cast(Any, workers),
        inboxes=[cast(Any, "inbox-0"), cast(Any, "inbox-1")],
        liveness=cast(Any, Beat()),
        logger=cast(Any, log),
    )


async def test_a_worker_ended_by_a_cancellation_not_its_own_stops_the_service() -> None:
    # Given the workers running
    workers, log = Workers(), Log()
    async with tasks_of(workers, log) as tasks:
        running_before = tasks.running

        # When a worker ends on a CancelledError nobody meant for it
        workers.cut_off.set()
        await asyncio.wait_for(tasks.failed.wait(), 5)

        # Then the service is told to stop (exit non-zero, its supervisor starts a new one): its
        # inbox has nothing to serve it any more, and the prefetch window fills with it
        assert running_before
        assert isinstance(tasks.fatal, PipelineFault)
        assert "worker-0" in str(tasks.fatal)
        assert not tasks.running
        # Not an event's fault: the marks of what was running do not convict it
        assert not tasks.died_of_a_bug
        assert log.errors == ["cannot go on"]


async def test_leaving_cancels_the_workers_and_is_no_failure() -> None:
    # Given the workers running
    workers, log = Workers(), Log()
    async with tasks_of(workers, log) as tasks:
        running_before = tasks.running

    # When the service leaves them (a graceful stop), then nothing failed
    assert running_before
    assert tasks.fatal is None
    assert not tasks.failed.is_set()
    assert not tasks.running
    assert log.errors == []
