"""Faults injected into a real service process from the inside, for failure paths that no outside
fault reaches on cue. Listed in ``CONSUMER_HANDLERS``, the module is imported at start-up and
patches the service before it runs; ``TEST_SABOTAGE`` names what to break:

- ``start_consuming``: the first ``basic.consume`` fails as aiormq fails it on a channel that is
  closing (``ChannelInvalidStateError``, a ``RuntimeError``);
- ``report``: reporting the outcome of a ``test.sabotage`` event raises, as a bug outside the
  handled exceptions would, killing the worker that settles it;
- ``ack_lost``: the ack of a ``test.sabotage`` event's first delivery is lost: after its commit,
  the ack is never sent and the consume connection closes instead, as a network that fails
  between the commit and the ack would have it; the broker delivers the event again, flagged
  redelivered;
- ``span_hooks``: with tracing on, a span processor on the provider raises whenever a span ends,
  and when a transaction's starts, as a library's processor may (the SDK does not catch what
  they raise).
"""

from __future__ import annotations

import asyncio
import os
from typing import Any, cast

import aiormq
import asyncpg
from pydantic import BaseModel

from consumer import Envelope, register
from consumer.amqp.delivery import Delivery
from consumer.amqp.session import BrokerSession
from consumer.observe.report import OutcomeReporter

SABOTAGE = os.environ.get("TEST_SABOTAGE", "")


class Nothing(BaseModel):
    key: str


@register("test.sabotage", payload=Nothing)
async def sabotaged(event: Envelope[Nothing], conn: asyncpg.Connection[Any]) -> None:
    await conn.execute(
        "INSERT INTO test_effects (event_id, key) VALUES ($1, $2)",
        event.event_id,
        event.payload.key,
    )


if "start_consuming" in SABOTAGE:
    _start_consuming = BrokerSession.start_consuming
    _failed_once = False

    async def _closing_channel(self: BrokerSession) -> None:
        global _failed_once
        if not _failed_once:
            _failed_once = True
            raise aiormq.exceptions.ChannelInvalidStateError("writer is None")
        await _start_consuming(self)

    BrokerSession.start_consuming = _closing_channel  # type: ignore[method-assign]

if "report" in SABOTAGE:
    _report = OutcomeReporter.report

    def _broken_report(self: OutcomeReporter, outcome: Any, settled: Any) -> None:
        if outcome.event is not None and outcome.event.type == "test.sabotage":
            raise ZeroDivisionError("a bug outside the handled exceptions")
        _report(self, outcome, settled)

    OutcomeReporter.report = _broken_report  # type: ignore[method-assign]

if "ack_lost" in SABOTAGE:
    _ack = Delivery.ack
    _lost: set[bytes] = set()
    _closing: set[asyncio.Task[Any]] = set()

    def _losing_ack(self: Delivery) -> None:
        if self.routing_key != "test.sabotage" or self.redelivered or self.body in _lost:
            _ack(self)
            return
        _lost.add(self.body)
        # The real channel's acker (consumer.amqp.acker.Acker), not the Settles protocol's face.
        connection = cast(Any, self.acker)._channel.connection
        closing = asyncio.get_running_loop().create_task(
            connection.close(ConnectionError("the ack was lost (sabotage)"))
        )
        _closing.add(closing)
        closing.add_done_callback(_closing.discard)

    Delivery.ack = _losing_ack  # type: ignore[method-assign]

if "span_hooks" in SABOTAGE:
    from opentelemetry import trace
    from opentelemetry.context import Context
    from opentelemetry.sdk.trace import ReadableSpan, Span, SpanProcessor

    from consumer.observe.otel import OtelTracing

    class _Raising(SpanProcessor):
        def on_start(self, span: Span, parent_context: Context | None = None) -> None:
            if span.name == "transaction":
                raise ZeroDivisionError("a span processor's bug (on_start)")

        def on_end(self, span: ReadableSpan) -> None:
            raise ZeroDivisionError("a span processor's bug (on_end)")

    _exporting = OtelTracing.exporting

    def _with_raising(service: str, exporters: Any) -> OtelTracing:
        tracing = _exporting(service, exporters)
        # The provider it made is the global one: what a library would add its processor to.
        provider: Any = trace.get_tracer_provider()
        provider.add_span_processor(_Raising())
        return tracing

    OtelTracing.exporting = _with_raising  # type: ignore[method-assign]
