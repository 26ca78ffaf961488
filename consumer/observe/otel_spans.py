"""What the service's spans carry, apart from when they start and end
(:mod:`consumer.observe.otel`): the parent context a message's headers name, the context written
onto a copy it publishes, and the attributes and status a span ends with."""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from opentelemetry.context import Context
from opentelemetry.trace import (
    NonRecordingSpan,
    Span,
    SpanContext,
    Status,
    StatusCode,
    TraceFlags,
    TraceState,
    set_span_in_context,
)

from consumer.error_text import error_name
from consumer.observe.traceparent import (
    TRACEPARENT,
    TRACESTATE,
    format_traceparent,
    read_traceparent,
    read_tracestate,
)
from consumer.pipeline.outcome import Applied, Failed, Rejected

if TYPE_CHECKING:
    from consumer.pipeline.outcome import Outcome, Settled

__all__ = ["end_abandoned", "end_settled", "inject", "mark_failed", "remote_parent"]

_NO_PARENT = Context()  # never an ambient span: a trace starts here or in the message


def remote_parent(headers: Mapping[str, Any] | None) -> Context:
    """The context ``headers`` carry (``traceparent``, ``tracestate``), or none if not valid."""
    parent = read_traceparent(headers)
    if parent is None:
        return _NO_PARENT
    members = read_tracestate(headers)
    pairs = [member.split("=", 1) for member in members or ()]
    state = TraceState([(key, value) for key, value in pairs]) if pairs else None
    context = SpanContext(
        parent.trace_id,
        parent.span_id,
        is_remote=True,
        trace_flags=TraceFlags(parent.flags),
        trace_state=state,
    )
    return set_span_in_context(NonRecordingSpan(context))


def inject(span: Span, headers: dict[str, Any]) -> None:
    context = span.get_span_context()
    headers[TRACEPARENT] = format_traceparent(
        context.trace_id, context.span_id, context.trace_flags
    )
    state = context.trace_state.to_header() if context.trace_state else ""
    if state:
        headers[TRACESTATE] = state
    else:
        headers.pop(TRACESTATE, None)


def mark_failed(span: Span, name: str) -> None:
    span.set_attribute("error.type", name)
    span.set_status(Status(StatusCode.ERROR, name))


def end_abandoned(span: Span) -> None:
    span.set_attribute("consumer.outcome", "unsettled")
    span.end()


def end_settled(span: Span, outcome: Outcome, settled: Settled) -> None:
    event, verdict = outcome.event, outcome.verdict
    if event is not None:
        span.set_attribute("consumer.event_id", str(event.event_id))
        span.set_attribute("consumer.event_type", event.type)
        if event.correlation_id is not None:
            span.set_attribute("messaging.message.conversation_id", event.correlation_id)
    span.set_attribute("consumer.outcome", settled.kind.value if settled.kind else "held")
    if isinstance(verdict, Failed):
        span.set_attribute("error.type", error_name(verdict.error))
        span.set_status(Status(StatusCode.ERROR, error_name(verdict.error)))
    elif isinstance(verdict, Rejected):
        span.set_attribute("error.type", verdict.poison.reason.value)
        span.set_status(Status(StatusCode.ERROR, verdict.poison.reason.value))
    elif isinstance(verdict, Applied) and settled.kind is not None:
        span.set_status(Status(StatusCode.OK))
    span.end()
