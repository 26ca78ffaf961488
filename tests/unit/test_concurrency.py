"""The choice in force: applied to the dispatcher, shown in metrics and the log, changed only when
measurements agree."""

from __future__ import annotations

from typing import Any

import structlog
from prometheus_client import CollectorRegistry

from consumer.observe.metrics import Metrics
from consumer.pipeline.handler_time import HandlerTime
from consumer.service.concurrency import Concurrency
from consumer.service.concurrency_policy import Limits


class _Dispatcher:
    def __init__(self) -> None:
        self.sizes: list[tuple[int, int]] = []

    def resize(self, *, workers: int, batch_size: int) -> None:
        self.sizes.append((workers, batch_size))


def _awaiting_batches(concurrency: Concurrency, tally: HandlerTime, count: int) -> None:
    """Batches of 10 events whose handlers each await 20 ms: a batch holds the loop 1 ms."""
    for _ in range(count):
        for _ in range(10):
            tally.handler(batch=False, wall=0.0201, cpu=0.0001)
        concurrency.batch_done(events=10, seconds=0.203, cpu=0.001)


def _built(limits: Limits) -> tuple[Concurrency, HandlerTime, _Dispatcher, Metrics, Any]:
    tally = HandlerTime()
    dispatcher = _Dispatcher()
    metrics = Metrics(CollectorRegistry(), ["example.type"])
    capture = structlog.testing.LogCapture()
    logger = structlog.wrap_logger(None, processors=[capture])
    concurrency = Concurrency(
        limits=limits,
        handler_time=tally,
        dispatcher=dispatcher,  # type: ignore[arg-type]
        metrics=metrics,
        logger=logger,
    )
    return concurrency, tally, dispatcher, metrics, capture


def test_awaiting_handlers_get_workers_shown_and_logged() -> None:
    concurrency, tally, dispatcher, metrics, capture = _built(Limits(prefetch=400, pool_size=4))
    assert dispatcher.sizes == [(1, 50)]  # the start
    _awaiting_batches(concurrency, tally, 20)
    assert concurrency.choice.workers == 4
    assert dispatcher.sizes[-1][0] == 4
    assert metrics.workers._value.get() == 4
    assert metrics.concurrency_changes._value.get() == 1
    (line,) = [entry for entry in capture.entries if entry["event"] == "concurrency changed"]
    assert (line["workers"], line["was_workers"], line["reason"]) == (4, 1, "handlers await")


def test_a_pinned_worker_count_never_changes() -> None:
    concurrency, tally, dispatcher, metrics, _ = _built(
        Limits(prefetch=400, pool_size=4, workers=1)
    )
    _awaiting_batches(concurrency, tally, 20)
    assert {workers for workers, _ in dispatcher.sizes} == {1}
    assert metrics.workers._value.get() == 1
