"""One log line and the metrics for each settled delivery."""

from __future__ import annotations

import logging
import time
from typing import Any

from pydantic import BaseModel

from consumer.amqp.headers import attempts_so_far, truncate
from consumer.classification import schema_missing
from consumer.error_text import error_name, message_of
from consumer.logs import MessageLog
from consumer.observe.metrics import Metrics
from consumer.pipeline.outcome import Applied, Failed, Outcome, OutcomeKind, Rejected, Settled
from consumer.pipeline.retry import DeadLetter, Retry
from consumer.pipeline.tracing import Tracing, trace_id_of
from topology.names import rung_label

__all__ = ["OutcomeReporter"]


class OutcomeReporter:
    """Logs ``message settled`` with the fields an operator filters on, and moves the metrics."""

    def __init__(
        self,
        log: MessageLog,
        metrics: Metrics,
        *,
        log_payloads: bool = False,
        tracing: Tracing | None = None,
    ) -> None:
        """``tracing``: the line names the trace of the delivery's span, when there is one."""
        self._log = log
        self._metrics = metrics
        self._log_payloads = log_payloads
        self._tracing = tracing or Tracing()

    def report(self, outcome: Outcome, settled: Settled) -> None:
        kind = settled.kind
        if kind is None:
            return  # held: reported when it is settled
        delivery, verdict, event = outcome.delivery, outcome.verdict, outcome.event
        metrics = self._metrics
        # Read straight off the frames: one line per message passes here.
        message = delivery.message
        properties = message.header.properties
        if event is not None:
            event_type: str | None = event.type
        else:
            # Poison: the type its body named, if it got that far (a payload its model refused).
            event_type = verdict.poison.event_type if isinstance(verdict, Rejected) else None
        type_label = metrics.type_label(event_type)
        metrics.count(event_type, kind)
        fields: dict[str, Any] = {
            "event_id": str(event.event_id) if event is not None else None,
            "type": event_type,
            "message_id": properties.message_id,
            "routing_key": message.routing_key or "",
            "redelivered": bool(message.redelivered),
            "attempt": attempts_so_far(delivery.headers),
            "outcome": kind.value,
            "duration_ms": round((time.monotonic() - delivery.received_at) * 1000, 2),
        }
        if event is not None and event.correlation_id is not None:
            fields["correlation_id"] = event.correlation_id
        span = self._tracing.span_of(delivery)
        if span is not None:
            fields["trace_id"] = trace_id_of(span)
        handler_seconds = outcome.handler_seconds
        if handler_seconds is not None:
            metrics.observe_handler(type_label, handler_seconds)
            fields["handler_ms"] = round(handler_seconds * 1000, 2)
        if type(verdict) is Applied:
            if not verdict.duplicate and event is not None:
                lag = (verdict.committed_at - event.occurred_at).total_seconds()
                metrics.observe_lag(type_label, lag if lag > 0.0 else 0.0)
            if verdict.note is None and not settled.channel_gone and not self._log_payloads:
                # The usual line: nothing below applies to it.
                self._log.write(logging.INFO, "message settled", fields)
                return
        if isinstance(verdict, Applied) and verdict.note is not None:
            fields["warning"] = truncate(verdict.note, 500)
        if isinstance(verdict, Rejected):
            fields["reason"] = verdict.poison.reason.value
            fields["error"] = truncate(verdict.poison.detail, 300)
            if verdict.poison.error_class is not None:
                fields["error_class"] = verdict.poison.error_class
            if settled.kind is OutcomeKind.POISON and not settled.channel_gone:
                metrics.dead_letters.labels(reason=verdict.poison.reason.value).inc()
        if isinstance(verdict, Failed):
            fields["error_class"] = error_name(verdict.error)
            if schema_missing(verdict.error):
                metrics.schema_missing.labels(type=type_label).inc()
            fields["error"] = truncate(message_of(verdict.error), 300)
            decision = verdict.decision
            if isinstance(decision, Retry):
                fields["rung"] = rung_label(decision.delay)
                if settled.kind is OutcomeKind.RETRIED:
                    metrics.retries.labels(rung=fields["rung"]).inc()
            elif isinstance(decision, DeadLetter):
                fields["reason"] = decision.reason.value
                if settled.kind is OutcomeKind.DEAD_LETTERED:
                    metrics.dead_letters.labels(reason=decision.reason.value).inc()
        if settled.publish_error is not None:
            metrics.publish_failures.inc()
            fields["publish_error"] = str(settled.publish_error)
        if settled.channel_gone:
            metrics.settle_lost.inc()
            fields["channel_gone"] = True
        if self._log_payloads and event is not None:
            payload = event.payload
            fields["payload"] = (
                payload.model_dump(mode="json") if isinstance(payload, BaseModel) else payload
            )
        bad = settled.kind in (OutcomeKind.DEAD_LETTERED, OutcomeKind.POISON) or "warning" in fields
        self._log.write(logging.WARNING if bad else logging.INFO, "message settled", fields)
