"""Tracing: which OTEL_* settings turn it on, that off it creates nothing, and the spans and
headers it makes when on (the SDK's in-memory exporter, the settler against a recording
publisher)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from datetime import timedelta
from typing import Any, cast

import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import SpanKind, StatusCode

from consumer.errors import ConfigError, TransientError
from consumer.observe.otel import OtelTracing
from consumer.observe.traceparent import read_traceparent
from consumer.observe.tracing_setup import TracingSetup, exporters_from
from consumer.pipeline.outcome import Applied, Failed, Outcome, Settled
from consumer.pipeline.ready import Ready
from consumer.pipeline.retry import Retry
from consumer.pipeline.tracing import Tracing, trace_id_of
from consumer.service.settle import Settler
from tests.support import REPO
from tests.unit.test_settle import NAMES, NOW, RecordingChannel, RecordingPublisher, deliveries

PRODUCER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
PRODUCER_SPAN = "00f067aa0ba902b7"


@pytest.mark.parametrize(
    ("environ", "expected"),
    [
        ({}, ()),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4318"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://c:4318/v1/traces"}, ("otlp",)),
        ({"OTEL_EXPORTER_OTLP_ENDPOINT": " "}, ()),
        ({"OTEL_TRACES_EXPORTER": "otlp"}, ("otlp",)),
        ({"OTEL_TRACES_EXPORTER": "console, OTLP,console"}, ("console", "otlp")),
        ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, ()),
        ({"OTEL_SDK_DISABLED": "true", "OTEL_TRACES_EXPORTER": "otlp"}, ()),
        ({"OTEL_SDK_DISABLED": "TRUE", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://c"}, ()),
        ({"OTEL_SDK_DISABLED": "false", "OTEL_TRACES_EXPORTER": "console"}, ("console",)),
        (
            {"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "http/protobuf"},
            ("otlp",),
        ),
        # The protocol matters only to the otlp exporter
        ({"OTEL_TRACES_EXPORTER": "console", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, ("console",)),
    ],
)
def test_tracing_is_on_only_when_the_otel_variables_ask(
    environ: dict[str, str], expected: tuple[str, ...]
) -> None:
    assert exporters_from(environ) == expected


@pytest.mark.parametrize(
    ("environ", "named"),
    [
        ({"OTEL_TRACES_EXPORTER": "zipkin"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "otlp,jaeger"}, "OTEL_TRACES_EXPORTER"),
        ({"OTEL_TRACES_EXPORTER": "otlp", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"}, "PROTOCOL"),
        (
            {"OTEL_EXPORTER_OTLP_ENDPOINT": "http://c", "OTEL_EXPORTER_OTLP_PROTOCOL": "grpc"},
            "OTEL_EXPORTER_OTLP_PROTOCOL",
        ),
    ],
)
def test_a_value_the_service_cannot_honour_stops_it_naming_the_variable(
    environ: dict[str, str], named: str
) -> None:
    with pytest.raises(ConfigError, match=named) as raised:
        exporters_from(environ)
    assert "\n" not in str(raised.value)


def _python(code: str, **environ: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO), **environ},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


_OFF_PATH = """
    import sys
    {prelude}
    from consumer.service.app import build_service  # the whole service's modules
    from consumer.observe.tracing_setup import TracingSetup
    from consumer.pipeline.tracing import Tracing
    from consumer.amqp.delivery import Delivery

    setup = TracingSetup.from_environment("svc")
    with setup as tracing:
        assert type(tracing) is Tracing and not tracing.enabled
        delivery = Delivery(message=None, acker=None)
        tracing.processing([delivery], "svc.work")
        assert tracing.span_of(delivery) is None
        headers = {{"traceparent": "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"}}
        with tracing.sending(headers, exchange="x", routing_key="k"), tracing.transaction([]):
            pass
        assert list(headers) == ["traceparent"]  # carried on untouched
    loaded = [n for n, m in sys.modules.items() if n.startswith("opentelemetry") and m]
    print(setup.missing_extra, bool(loaded))
"""


def test_unconfigured_tracing_creates_nothing_and_never_imports_opentelemetry() -> None:
    result = _python(_OFF_PATH.format(prelude=""))

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["False", "False"]


def test_without_the_extra_configured_tracing_is_off_and_says_so() -> None:
    # The extra absent: every opentelemetry import fails, as in an install without it.
    prelude = "sys.modules['opentelemetry'] = None"
    result = _python(_OFF_PATH.format(prelude=prelude), OTEL_TRACES_EXPORTER="console")

    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["True", "False"]


@pytest.fixture
def exported() -> InMemorySpanExporter:
    return InMemorySpanExporter()


@pytest.fixture
def tracing(exported: InMemorySpanExporter) -> Iterator[OtelTracing]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exported))
    traced = OtelTracing(provider.get_tracer("test"), provider)
    yield traced
    traced.close()


def _finished(exported: InMemorySpanExporter, name: str) -> list[ReadableSpan]:
    return [span for span in exported.get_finished_spans() if span.name.startswith(name)]


async def test_a_retry_copy_carries_on_the_trace_of_the_delivery_it_copies(
    tracing: OtelTracing, exported: InMemorySpanExporter
) -> None:
    # Given a delivery with its producer's traceparent, processed with tracing on
    channel, publisher = RecordingChannel(), RecordingPublisher()
    (delivery,) = deliveries(channel, 1)
    delivery.headers["traceparent"] = f"00-{PRODUCER_TRACE}-{PRODUCER_SPAN}-01"
    tracing.processing([delivery], "svc.work")
    assert trace_id_of(tracing.span_of(delivery)) == PRODUCER_TRACE

    # When it fails transiently and the settler publishes its retry copy
    settler = Settler(names=NAMES, publish_failure_pause=0.0, tracing=tracing)
    settler.publisher = cast(Any, publisher)
    outcome = Outcome(delivery, Failed(TransientError("t"), Retry(0, timedelta(seconds=1), 1), 0))
    (settled,) = await settler.settle([outcome])
    tracing.settled(outcome, settled)

    # Then: process span (child of the producer's) -> publish span, whose context the copy carries
    (process,) = _finished(exported, "process")
    (copy,) = _finished(exported, "publish")
    assert process.kind is SpanKind.CONSUMER
    assert process.parent is not None
    assert process.parent.is_remote
    assert f"{process.parent.span_id:016x}" == PRODUCER_SPAN
    assert process.attributes is not None
    assert process.attributes["consumer.outcome"] == "retried"
    assert process.status.status_code is StatusCode.ERROR
    assert copy.kind is SpanKind.PRODUCER
    assert copy.parent is not None
    assert process.context is not None
    assert copy.context is not None
    assert copy.parent.span_id == process.context.span_id
    assert copy.attributes is not None
    assert copy.attributes["messaging.destination.name"] == "svc.retry"
    assert copy.attributes["messaging.operation.type"] == "send"
    ((_, _, headers),) = publisher.published
    carried = read_traceparent(headers)
    assert carried is not None
    assert (carried.trace_id, carried.span_id) == (copy.context.trace_id, copy.context.span_id)
    assert tracing.span_of(delivery) is None


async def test_a_hostile_traceparent_starts_a_trace_of_its_own(
    tracing: OtelTracing, exported: InMemorySpanExporter
) -> None:
    (delivery,) = deliveries(RecordingChannel(), 1)
    delivery.headers["traceparent"] = "00-" + "z" * 5000

    started = tracing.processing([delivery], "svc.work")
    tracing.abandoned(started)

    (process,) = _finished(exported, "process")
    assert process.parent is None
    assert process.attributes is not None
    assert process.attributes["consumer.outcome"] == "unsettled"


def test_a_batch_transaction_is_the_first_events_child_and_links_the_others(
    tracing: OtelTracing, exported: InMemorySpanExporter
) -> None:
    batch = deliveries(RecordingChannel(), 3)
    tracing.processing(batch, "svc.work")
    items = [Ready(delivery, cast(Any, None), cast(Any, None)) for delivery in batch]

    with tracing.transaction(items):
        pass
    for delivery in batch:
        tracing.settled(Outcome(delivery, Applied(False, NOW)), Settled(None))

    (transaction,) = _finished(exported, "transaction")
    processes = _finished(exported, "process")
    contexts = [span.context for span in processes]
    assert transaction.parent is not None
    assert contexts[0] is not None
    assert transaction.parent.span_id == contexts[0].span_id
    assert [link.context for link in transaction.links] == contexts[1:]
    assert transaction.attributes is not None
    assert transaction.attributes["messaging.batch.message_count"] == 3
    assert {span.attributes["consumer.outcome"] for span in processes if span.attributes} == {
        "held"
    }


def test_tracing_off_is_the_base_class_whose_hooks_do_nothing() -> None:
    setup = TracingSetup("svc", ())
    with setup as off:
        assert type(off) is Tracing
        assert off.transaction([]) is off.transaction([])  # one reused, nothing made per call
    assert not setup.missing_extra


def test_a_failed_transaction_names_the_error_type_and_never_its_message(
    tracing: OtelTracing, exported: InMemorySpanExporter
) -> None:
    (delivery,) = deliveries(RecordingChannel(), 1)
    tracing.processing([delivery], "svc.work")
    items = [Ready(delivery, cast(Any, None), cast(Any, None))]

    with pytest.raises(TransientError), tracing.transaction(items):
        raise TransientError("postgresql://app:secret@db/x is away")

    (transaction,) = _finished(exported, "transaction")
    assert transaction.status.status_code is StatusCode.ERROR
    assert transaction.status.description == "TransientError"
    assert transaction.attributes is not None
    assert transaction.attributes["error.type"] == "TransientError"
    assert not transaction.events  # no exception event: no message, no traceback


def test_a_worker_ends_only_the_spans_it_started_and_left_open(
    tracing: OtelTracing, exported: InMemorySpanExporter
) -> None:
    # Given a delivery held (its span ended by settled) and taken by another worker since
    (delivery,) = deliveries(RecordingChannel(), 1)
    first = tracing.processing([delivery], "svc.work")
    tracing.settled(Outcome(delivery, Applied(False, NOW)), Settled(None))
    tracing.processing([delivery], "svc.work")
    theirs = tracing.span_of(delivery)

    # When the first worker's clean-up runs
    tracing.abandoned(first)

    # Then the other worker's span is still open, on the delivery
    assert tracing.span_of(delivery) is theirs
    (held,) = _finished(exported, "process")
    assert held.attributes is not None
    assert held.attributes["consumer.outcome"] == "held"


class _EndRaises(SpanProcessor):
    """Breaks the SDK's rule that a processor never raises, as a library's may."""

    def on_end(self, span: ReadableSpan) -> None:
        raise ZeroDivisionError("a span processor's bug")


async def test_a_span_processor_that_raises_never_reaches_the_work_it_traces() -> None:
    provider = TracerProvider()
    provider.add_span_processor(_EndRaises())
    tracing = OtelTracing(provider.get_tracer("test"), provider)
    (delivery,) = deliveries(RecordingChannel(), 1)
    items = [Ready(delivery, cast(Any, None), cast(Any, None))]

    # A transaction that commits is not failed by its span's end; one that fails, fails with
    # its own error
    started = tracing.processing([delivery], "svc.work")
    with tracing.transaction(items):
        pass
    with pytest.raises(TransientError), tracing.transaction(items):
        raise TransientError("its own")
    headers: dict[str, Any] = {}
    with tracing.sending(
        headers, exchange="svc.retry", routing_key="t", parent=tracing.span_of(delivery)
    ):
        pass
    tracing.settled(Outcome(delivery, Applied(False, NOW)), Settled(None))
    tracing.abandoned(started)
    tracing.close()

    assert read_traceparent(headers) is not None  # the copy still carries the trace
    assert tracing.span_of(delivery) is None
