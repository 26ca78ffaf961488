"""The workers' tasks (the isolated one's too), watched for the whole life of the service, and the
liveness beat beside them. :class:`consumer.service.supervisor.Service` runs them.

A worker that ends by itself leaves its deliveries with nothing to serve them, so it
ends the service: :attr:`WorkerTasks.fatal` is set, and the service stops (exit non-zero) for
its supervisor to start a new one.
"""

from __future__ import annotations

import asyncio
import traceback
from collections.abc import Sequence

from consumer.amqp.delivery import Delivery
from consumer.db.crashes import Liveness
from consumer.error_text import error_name
from consumer.errors import ConfigError, PipelineFault
from consumer.logs import Logger
from consumer.service.inbox import Inbox
from consumer.service.workers import Workers

__all__ = ["WorkerTasks"]


class WorkerTasks:
    """A task per inbox and one for the isolated deliveries, watched; cancelled, with the beat, on
    exit."""

    def __init__(
        self,
        *,
        workers: Workers,
        inboxes: Sequence[Inbox[Delivery]],
        liveness: Liveness,
        logger: Logger,
    ) -> None:
        self._workers = workers
        self._inboxes = inboxes
        self._liveness = liveness
        self._logger = logger
        self._tasks: list[asyncio.Task[None]] = []
        self._beat: asyncio.Task[None] | None = None
        self.fatal: BaseException | None = None
        """What made the service stop early, raised once it has stopped."""
        self.failed = asyncio.Event()
        """Set with :attr:`fatal`, for the loops that wait on the broker to notice."""
        self.died_of_a_bug = False
        """A task ended on an unexpected error: the marks of what was running stay."""

    async def __aenter__(self) -> WorkerTasks:
        self._tasks = [
            asyncio.create_task(self._workers.worker(inbox), name=f"worker-{index}")
            for index, inbox in enumerate(self._inboxes)
        ]
        self._tasks.append(asyncio.create_task(self._workers.isolated(), name="isolated"))
        for task in self._tasks:
            task.add_done_callback(self._task_ended)
        # Not watched like the workers: it ends by design at a graceful stop, before them.
        self._beat = asyncio.create_task(self._liveness.keep(), name="liveness")
        return self

    async def __aexit__(self, *_: object) -> None:
        tasks, self._tasks = self._tasks, []
        beat, self._beat = self._beat, None
        for task in tasks:
            task.remove_done_callback(self._task_ended)
            task.cancel()
        if beat is not None:
            beat.cancel()
            tasks.append(beat)
        await asyncio.gather(*tasks, return_exceptions=True)

    @property
    def running(self) -> bool:
        """Every worker started and still running (``/readyz``)."""
        return bool(self._tasks) and not any(task.done() for task in self._tasks)

    def _task_ended(self, task: asyncio.Task[None]) -> None:
        """A worker ended by itself: nothing would serve its deliveries any more, so
        the service stops (exit non-zero) and the supervisor starts a new one."""
        if task.cancelled():
            # Never this class's own cancel (__aexit__ drops this callback first): a library's
            # CancelledError ended it, as aiormq's does a publish's once a heartbeat ran out.
            # Not an event's fault, and its inbox has nothing to serve it any more.
            self._fail(PipelineFault(f"{task.get_name()} stopped: cancelled by a library"))
            return
        error = task.exception()
        if error is None:
            error = PipelineFault(f"{task.get_name()} stopped")
        elif not isinstance(error, PipelineFault | ConfigError):
            # Not a deployment's fault (those are PipelineFault or ConfigError, and would convict
            # whatever event was running): the marks of what was running stay.
            self.died_of_a_bug = True
            self._logger.error(
                "a worker stopped on an unexpected error",
                task=task.get_name(),
                error_class=error_name(error),
                error=str(error),
                traceback="".join(traceback.format_exception(error)),
            )
            error = PipelineFault(
                f"{task.get_name()} stopped on an unexpected error: {error_name(error)}: {error}"
            )
        self._fail(error)

    def _fail(self, error: BaseException) -> None:
        if self.fatal is None:
            self._logger.error("cannot go on", error=str(error), error_class=type(error).__name__)
            self.fatal = error
            self.failed.set()
