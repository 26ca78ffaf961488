"""One way in for both modes: :func:`harness` runs in process, or on the broker when asked."""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any, Protocol

from consumer.registry import HandlerRegistry
from consumer.testing.harness import InProcessHarness
from consumer.testing.messages import Message
from consumer.testing.outcomes import EventOutcome
from consumer.testing.settings import broker_requested, harness_settings

__all__ = ["Harness", "harness"]


class Harness(Protocol):
    """What a test does with a harness, in either mode."""

    mode: str
    """``in-process`` or ``broker``."""

    @property
    def database_url(self) -> str:
        """The database the handlers write to: connect to it to check their rows."""

    @property
    def waiting(self) -> int:
        """Retry copies on the ladder that have not come back yet."""

    @property
    def lines(self) -> list[dict[str, Any]]:
        """The service's ``message settled`` log lines so far (their fields), in order."""

    async def send(self, *messages: Message) -> list[EventOutcome]:
        """Publish ``messages`` to the work queue together; each one's outcome, in order."""

    async def redeliver(self) -> list[EventOutcome]:
        """The retry copies on the ladder come back (attempt raised); their outcomes."""


@asynccontextmanager
async def harness(
    handlers: Sequence[str],
    database_url: str,
    *,
    broker: bool | None = None,
    **settings: Any,
) -> AsyncIterator[Harness]:
    """A harness for the handler modules ``handlers`` on the (migrated) database at
    ``database_url``: in process, or on the real broker when ``broker`` is true (by default when
    ``CONSUMER_TEST_BROKER=1``). ``settings`` override the environment's ``CONSUMER_*`` by field
    name. Whatever it made on the broker is removed on exit."""
    config = harness_settings(handlers, database_url, **settings)
    registry = HandlerRegistry.from_modules(config.handlers)
    if broker is None:
        broker = broker_requested()
    if broker:
        from consumer.testing.broker import BrokerHarness  # aio-pika only then

        async with BrokerHarness(config, registry) as on_broker:
            yield on_broker
        return
    async with InProcessHarness(config, registry) as in_process:
        yield in_process
