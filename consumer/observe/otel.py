"""Tracing with OpenTelemetry (the ``otel`` extra): spans after the messaging conventions.

Imported only by :class:`consumer.observe.tracing_setup.TracingSetup`, and only when tracing is
asked for. One trace follows an event from its producer to its commit::

    publish <exchange>   PRODUCER (the producer; `consumer publish`)
      process <queue>    CONSUMER, one per delivery, the producer's traceparent its parent
        transaction      INTERNAL, the receipt and the handler's effect
        publish <retry>  PRODUCER, the retry copy, which carries this span's context on
          process <queue>  the retried delivery, and so on to its commit or the dead letter

A batch shares one transaction: its span is a child of the first event's span and links to every
other's. Attributes follow the OpenTelemetry messaging conventions for RabbitMQ
(``messaging.destination.name`` is the exchange).

No hook ever raises: the SDK calls its span processors (ours, and any a library adds to the global
provider) on the thread that starts or ends a span, without catching what they raise. A failure
there would otherwise end the worker settling a batch (stopping the service, its deliveries
redelivered with their counts raised), or fail a committed transaction. What fails is logged once
per hook and kind of error, and the delivery goes on, untraced where need be.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from typing import TYPE_CHECKING, Any
from weakref import WeakKeyDictionary

from opentelemetry.sdk.resources import SERVICE_NAME, Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, ConsoleSpanExporter, SpanExporter
from opentelemetry.trace import (
    Link,
    Span,
    SpanKind,
    Tracer,
    set_span_in_context,
    set_tracer_provider,
    use_span,
)

from consumer.amqp.headers import attempts_so_far
from consumer.error_text import error_name
from consumer.observe.otel_spans import (
    end_abandoned,
    end_settled,
    inject,
    mark_failed,
    remote_parent,
)
from consumer.pipeline.tracing import Started, Tracing
from consumer.version import __version__

if TYPE_CHECKING:
    from consumer.amqp.delivery import Delivery
    from consumer.pipeline.outcome import Outcome, Settled
    from consumer.pipeline.ready import Ready

__all__ = ["OtelTracing"]

_RABBITMQ = "rabbitmq"
_LOG = logging.getLogger(__name__)  # routed to the service's JSON log (route_library_logs)


class OtelTracing(Tracing):
    """Tracing on: see the module docstring for the spans."""

    enabled = True

    def __init__(self, tracer: Tracer, provider: TracerProvider | None = None) -> None:
        super().__init__()
        self._tracer = tracer
        self._provider = provider
        self._failed: set[tuple[str, str]] = set()
        # Each delivery's processing span while a worker has it (gone with the delivery).
        self._spans: WeakKeyDictionary[Delivery, Span] = WeakKeyDictionary()

    def _safely(self, hook: str, step: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``step(*args, **kwargs)``, or None if it raised: logged once per hook and error type."""
        try:
            return step(*args, **kwargs)
        except Exception as error:
            key = (hook, error_name(error))
            if key not in self._failed:
                self._failed.add(key)
                _LOG.warning(
                    "tracing: %s failed (%s); the service goes on without that span",
                    hook,
                    key[1],
                )
            return None

    @classmethod
    def exporting(cls, service: str, exporters: Sequence[str]) -> OtelTracing:
        """A tracer whose spans go, in batches, to ``exporters`` (``otlp``, ``console``).

        Its provider is also OpenTelemetry's global one (the first a process sets; a later one
        is refused with a warning): the libraries a handler calls, if instrumented, trace into
        the same pipeline, as children of the transaction's span."""
        attributes: dict[str, Any] = {}
        named = os.environ.get("OTEL_SERVICE_NAME") or "service.name=" in os.environ.get(
            "OTEL_RESOURCE_ATTRIBUTES", ""
        )
        if not named:
            attributes[SERVICE_NAME] = service
        # Not registered with atexit: TracingSetup shuts it down, once, where it is opened.
        provider = TracerProvider(resource=Resource.create(attributes), shutdown_on_exit=False)
        for name in exporters:
            exporter: SpanExporter
            if name == "otlp":
                from opentelemetry.exporter.otlp.proto.http.trace_exporter import (
                    OTLPSpanExporter,
                )

                exporter = OTLPSpanExporter()
            else:
                # stderr: stdout is the service's JSON log lines.
                exporter = ConsoleSpanExporter(out=sys.stderr)
            provider.add_span_processor(BatchSpanProcessor(exporter))
        set_tracer_provider(provider)
        return cls(provider.get_tracer("rabbit-pg-consumer", __version__), provider)

    def close(self) -> None:
        provider, self._provider = self._provider, None
        if provider is not None:
            self._safely("shutdown", provider.shutdown)

    # -- deliveries ---------------------------------------------------------------------------

    def processing(self, deliveries: Iterable[Delivery], queue: str) -> Started:
        name = f"process {queue}"
        started: list[tuple[Delivery, Any]] = []
        for delivery in deliveries:
            attributes: dict[str, Any] = {
                "messaging.system": _RABBITMQ,
                "messaging.operation.type": "process",
                "messaging.operation.name": "process",
                "messaging.destination.name": delivery.exchange,
                "messaging.destination.subscription.name": queue,
                "messaging.rabbitmq.destination.routing_key": delivery.routing_key,
                "messaging.rabbitmq.message.delivery_tag": delivery.delivery_tag,
                "messaging.message.body.size": len(delivery.body),
                "consumer.attempt": attempts_so_far(delivery.headers),
            }
            if delivery.message_id is not None:
                attributes["messaging.message.id"] = delivery.message_id
            span = self._safely(
                "starting a delivery's span",
                self._tracer.start_span,
                name,
                context=remote_parent(delivery.headers),  # total: never raises
                kind=SpanKind.CONSUMER,
                attributes=attributes,
            )
            if span is not None:
                self._spans[delivery] = span
                started.append((delivery, span))
        return started

    def span_of(self, delivery: Delivery) -> Any:
        return self._spans.get(delivery)

    def settled(self, outcome: Outcome, settled: Settled) -> None:
        span = self._spans.pop(outcome.delivery, None)
        if span is None:
            return
        self._safely("ending a delivery's span", end_settled, span, outcome, settled)

    def abandoned(self, started: Started) -> None:
        spans = self._spans
        for delivery, span in started or ():
            if spans.get(delivery) is span:  # not ended by settled(), nor another worker's since
                del spans[delivery]
                self._safely("ending an abandoned span", end_abandoned, span)

    # -- inside a delivery's span -------------------------------------------------------------

    def transaction(self, items: Sequence[Ready]) -> AbstractContextManager[None]:
        return self._transaction(items)

    @contextmanager
    def _transaction(self, items: Sequence[Ready]) -> Iterator[None]:
        spans = [span for item in items if (span := self._spans.get(item.delivery)) is not None]
        attributes: dict[str, Any] = {"db.system.name": "postgresql"}
        if len(items) > 1:
            attributes["messaging.batch.message_count"] = len(items)
        span = self._safely(
            "starting a transaction's span",
            self._tracer.start_span,
            "transaction",
            context=set_span_in_context(spans[0]) if spans else None,
            kind=SpanKind.INTERNAL,
            links=[Link(span.get_span_context()) for span in spans[1:]],
            attributes=attributes,
        )
        # Current while it runs: a handler's own instrumented calls become its children.
        with self._failing_by_type(span, "a transaction's span"):
            yield

    def sending(
        self,
        headers: dict[str, Any],
        *,
        exchange: str,
        routing_key: str,
        message_id: str | None = None,
        parent: Any = None,
    ) -> AbstractContextManager[None]:
        return self._sending(headers, exchange, routing_key, message_id, parent)

    @contextmanager
    def _sending(
        self,
        headers: dict[str, Any],
        exchange: str,
        routing_key: str,
        message_id: str | None,
        parent: Span | None,
    ) -> Iterator[None]:
        attributes: dict[str, Any] = {
            "messaging.system": _RABBITMQ,
            "messaging.operation.type": "send",
            "messaging.operation.name": "publish",
            "messaging.destination.name": exchange,
            "messaging.rabbitmq.destination.routing_key": routing_key,
        }
        if message_id is not None:
            attributes["messaging.message.id"] = message_id
        context = set_span_in_context(parent) if parent is not None else remote_parent(headers)
        span = self._safely(
            "starting a publish's span",
            self._tracer.start_span,
            f"publish {exchange}",
            context=context,
            kind=SpanKind.PRODUCER,
            attributes=attributes,
        )
        if span is not None:
            self._safely("carrying the trace on", inject, span, headers)
        with self._failing_by_type(span, "a publish's span"):
            yield

    @contextmanager
    def _failing_by_type(self, span: Span | None, what: str) -> Iterator[None]:
        """``span`` current, then ended; an exception sets its status by the error's type alone.
        Not the message, nor a traceback (the SDK's default): a handler's error can quote the
        payload, a driver's a URL, and spans leave the process without the logs' scrubbing.
        Ending it (its processors) never raises into the work it spans."""
        if span is None:
            yield
            return
        try:
            with use_span(span, record_exception=False, set_status_on_exception=False):
                try:
                    yield
                except BaseException as error:
                    name = error_name(error)
                    self._safely(f"marking {what} failed", mark_failed, span, name)
                    raise
        finally:
            self._safely(f"ending {what}", span.end)
