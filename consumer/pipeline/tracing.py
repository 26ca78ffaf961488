"""Tracing as the service sees it: the hooks each delivery passes, and the span around a publish.

:class:`Tracing` is this port, and tracing off: every method does nothing and creates nothing (no
span, no context read from a header), which is what each delivery costs when tracing is off.
:class:`consumer.observe.otel.OtelTracing` is the adapter that traces, made by
:class:`consumer.observe.tracing_setup.TracingSetup` when the ``OTEL_*`` variables ask for it.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import TYPE_CHECKING, Any, TypeAlias

from pamqp.commands import Basic

if TYPE_CHECKING:
    from consumer.amqp.delivery import Delivery
    from consumer.pipeline.outcome import Outcome, Settled
    from consumer.pipeline.ready import Ready

__all__ = ["Started", "Tracing", "publish_span", "trace_id_of"]

Started: TypeAlias = "list[tuple[Delivery, Any]] | None"
"""The spans a worker started, by delivery (None when tracing is off: nothing started)."""


class Tracing:
    """Tracing off: the hooks the service calls, each doing nothing.

    :class:`consumer.observe.otel.OtelTracing` is the one that traces: a CONSUMER span per delivery
    from :meth:`processing` until :meth:`settled` (or :meth:`abandoned`), continuing the producer's
    trace; a span per database transaction inside it; a PRODUCER span per copy published, whose
    context the copy carries on.
    """

    enabled = False

    def __init__(self) -> None:
        # One, reused: entering and leaving it is all a transaction or publish costs when off.
        self._nothing: AbstractContextManager[None] = nullcontext()

    def processing(self, deliveries: Iterable[Delivery], queue: str) -> Started:
        """A span for each of ``deliveries`` taken from ``queue``, kept by the tracer until the
        delivery is settled (:meth:`span_of`); what was started, for :meth:`abandoned`."""
        return None

    def span_of(self, delivery: Delivery) -> Any:
        """``delivery``'s processing span while a worker has it; None when tracing is off."""
        return None

    def settled(self, outcome: Outcome, settled: Settled) -> None:
        """``outcome``'s delivery is settled (or held): its span ends, saying how."""

    def abandoned(self, started: Started) -> None:
        """End the spans of ``started`` that are still open (their worker stopped on an error,
        or a shutdown cancelled it), and only those: a held delivery may be another worker's
        by now, with a span of its own."""

    def transaction(self, items: Sequence[Ready]) -> AbstractContextManager[None]:
        """Around one database transaction applying ``items`` (current while it runs)."""
        return self._nothing

    def sending(
        self,
        headers: dict[str, Any],
        *,
        exchange: str,
        routing_key: str,
        message_id: str | None = None,
        parent: Any = None,
    ) -> AbstractContextManager[None]:
        """Around publishing a message with ``headers``, into which the span's context goes.

        ``parent``: the span of the delivery the message is a copy of; without it, the trace
        ``headers`` carry already (a replayed dead letter's) goes on, or a new one starts.
        """
        return self._nothing

    def close(self) -> None:
        """Send what is still buffered; nothing to do when off."""


def trace_id_of(span: Any) -> str:
    """The trace id of ``span`` (an OpenTelemetry span) as 32 hex digits, as collectors show
    it: what a log line names the trace by."""
    return f"{span.get_span_context().trace_id:032x}"


def publish_span(
    tracing: Tracing,
    properties: Basic.Properties,
    *,
    exchange: str,
    routing_key: str,
    parent: Any = None,
) -> AbstractContextManager[None]:
    """The PRODUCER span around one publish, its context carried in the message's headers;
    nothing when tracing is off (no headers table is added then). The one place such a span is
    made: the retry and dead-letter copies (``parent``: the span of the delivery copied), the
    replayed dead letters, ``consumer publish``."""
    if not tracing.enabled:
        return nullcontext()
    if properties.headers is None:
        properties.headers = {}
    return tracing.sending(
        properties.headers,
        exchange=exchange,
        routing_key=routing_key,
        message_id=properties.message_id,
        parent=parent,
    )
