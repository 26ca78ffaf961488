"""Tracing: off unless the standard ``OTEL_*`` variables ask for it and the ``otel`` extra is here.

:class:`Tracing` is the service's tracer as its callers see it. This base class is tracing off:
every method does nothing and creates nothing (no span, no context read from a header), which is
what each delivery costs when tracing is off. :class:`TracingSetup` reads the environment, as the
OpenTelemetry specification defines it:

- ``OTEL_SDK_DISABLED=true``: off, whatever else is set;
- ``OTEL_TRACES_EXPORTER``: ``otlp`` (HTTP/protobuf), ``console``, or ``none`` (off);
  comma-separated for several;
- unset, tracing is on (``otlp``) only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` names a collector.

The rest (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*``, the exporter's ``OTEL_EXPORTER_OTLP_*``) is the SDK's own to read. Only this module
imports :mod:`consumer.observe.otel`, which imports OpenTelemetry: the core runs without the extra.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from types import TracebackType
from typing import TYPE_CHECKING, Any, TypeAlias

from consumer.errors import ConfigError

if TYPE_CHECKING:
    from consumer.amqp.delivery import Delivery, Ready
    from consumer.pipeline.outcome import Outcome
    from consumer.service.settle import Settled

__all__ = ["EXPORTERS", "Started", "Tracing", "TracingSetup", "exporters_from", "trace_id_of"]

EXPORTERS = ("otlp", "console")
Started: TypeAlias = "list[tuple[Delivery, Any]] | None"
"""The spans a worker started, by delivery (None when tracing is off: nothing started)."""
_PROTOCOL = "http/protobuf"


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
        """A span for each of ``deliveries`` taken from ``queue``, kept on ``delivery.span``;
        what was started, for :meth:`abandoned`."""
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


def _flag(environ: Mapping[str, str], name: str) -> bool:
    return environ.get(name, "").strip().lower() == "true"


def exporters_from(environ: Mapping[str, str]) -> tuple[str, ...]:
    """The span exporters ``environ`` asks for; none means tracing is off. A value this service
    cannot honour is a bad setting (:class:`ConfigError` naming it), not a silent no."""
    if _flag(environ, "OTEL_SDK_DISABLED"):
        return ()
    raw = environ.get("OTEL_TRACES_EXPORTER", "").strip()
    names: tuple[str, ...]
    if raw:
        names = tuple(dict.fromkeys(n.strip().lower() for n in raw.split(",") if n.strip()))
    else:
        endpoints = ("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_EXPORTER_OTLP_ENDPOINT")
        names = ("otlp",) if any(environ.get(name, "").strip() for name in endpoints) else ()
    if "none" in names:
        return ()
    for name in names:
        if name not in EXPORTERS:
            raise ConfigError(
                f"OTEL_TRACES_EXPORTER: {name[:40]!r} is not one of otlp, console, none"
            )
    for variable in ("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL", "OTEL_EXPORTER_OTLP_PROTOCOL"):
        protocol = environ.get(variable, "").strip()
        if "otlp" in names and protocol and protocol != _PROTOCOL:
            raise ConfigError(
                f"{variable}: {protocol[:40]!r} is not supported; the service exports traces "
                f"over {_PROTOCOL}"
            )
        if protocol:
            break  # the traces' own setting wins over the general one
    return names


class TracingSetup:
    """The tracer for one process, from the environment: ``with`` or ``async with`` it; leaving
    sends the spans still buffered (the async form waits for that in a thread).

    ``missing_extra`` says tracing was asked for but the ``otel`` extra is not installed: tracing
    is then off, and the caller says so once at start-up.
    """

    def __init__(self, service: str, exporters: tuple[str, ...]) -> None:
        self._service = service
        self._exporters = exporters
        self._tracing: Tracing | None = None
        self.missing_extra = False

    @classmethod
    def from_environment(
        cls, service: str, environ: Mapping[str, str] | None = None
    ) -> TracingSetup:
        """Raises :class:`ConfigError` for an ``OTEL_*`` value the service cannot honour."""
        return cls(service, exporters_from(os.environ if environ is None else environ))

    def open(self) -> Tracing:
        if self._tracing is not None:
            return self._tracing
        tracing = Tracing()
        if self._exporters:
            try:
                from consumer.observe.otel import OtelTracing
            except ImportError:
                self.missing_extra = True
            else:
                tracing = OtelTracing.exporting(self._service, self._exporters)
        self._tracing = tracing
        return tracing

    def close(self) -> None:
        tracing, self._tracing = self._tracing, None
        if tracing is not None:
            tracing.close()

    def __enter__(self) -> Tracing:
        return self.open()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    async def __aenter__(self) -> Tracing:
        return self.open()

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        # The exporter's last send blocks on the network: not on the event loop.
        await asyncio.shield(asyncio.to_thread(self.close))
