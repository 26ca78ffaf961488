"""The prefetch window's one owner: what the dispatcher asks ("is it full?") and what the
``consumer_in_flight`` gauge shows are read from the same session, across reconnects."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

import structlog
from prometheus_client import CollectorRegistry

from consumer.config.settings import Settings
from consumer.observe.metrics import Metrics
from consumer.pipeline.calls import HandlerCalls
from consumer.registry import HandlerRegistry
from consumer.service.app import build_service
from consumer.service.window import PrefetchWindow


@dataclass
class _Session:
    unsettled: int


def test_the_window_is_empty_while_disconnected_and_full_at_the_prefetch() -> None:
    window = PrefetchWindow(400)
    assert (window.in_flight(), window.full()) == (0, False)

    window.session = _Session(unsettled=399)
    assert (window.in_flight(), window.full()) == (399, False)

    window.session = _Session(unsettled=400)
    assert (window.in_flight(), window.full()) == (400, True)

    window.session = None  # the connection went: the broker has them back
    assert window.full() is False


def test_the_service_the_dispatcher_and_the_gauge_read_one_window() -> None:
    settings = Settings(prefetch=10)
    registry = CollectorRegistry()
    metrics = Metrics(registry, ["example.type"])
    service = build_service(
        settings,
        HandlerRegistry([]),
        structlog.get_logger(),
        metrics,
        calls=HandlerCalls(),
        owner=uuid.uuid4(),
    )
    window = service._window
    dispatcher = service._dispatcher

    window.session = _Session(unsettled=10)

    assert dispatcher.window_full() is True
    assert registry.get_sample_value("consumer_in_flight") == 10
