"""The tracer for one process, from the standard ``OTEL_*`` variables, as the OpenTelemetry
specification defines them:

- ``OTEL_SDK_DISABLED=true``: off, whatever else is set;
- ``OTEL_TRACES_EXPORTER``: ``otlp`` (HTTP/protobuf), ``console``, or ``none`` (off);
  comma-separated for several;
- unset, tracing is on (``otlp``) only when ``OTEL_EXPORTER_OTLP_ENDPOINT`` or
  ``OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`` names a collector.

The rest (``OTEL_SERVICE_NAME``, ``OTEL_RESOURCE_ATTRIBUTES``, ``OTEL_TRACES_SAMPLER``,
``OTEL_BSP_*``, the exporter's ``OTEL_EXPORTER_OTLP_*``) is the SDK's own to read. Only this module
imports :mod:`consumer.observe.otel`, which imports OpenTelemetry, and only when tracing is asked
for: the core runs without the ``otel`` extra.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from types import TracebackType

from consumer.errors import ConfigError
from consumer.pipeline.tracing import Tracing

__all__ = ["EXPORTERS", "TracingSetup", "exporters_from"]

EXPORTERS = ("otlp", "console")
_PROTOCOL = "http/protobuf"


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
