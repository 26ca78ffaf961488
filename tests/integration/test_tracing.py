"""Tracing end to end: one trace from a producer's publish, through retries and the dead-letter
queue, to the commit, on the real broker and database.

The producer publishes in the test's process, traced by the SDK's in-memory exporter; the service
(and ``dlq replay``) run as processes that export over OTLP/HTTP to a collector the test runs.
"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp.web
import pytest
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
    ExportTraceServiceRequest,
    ExportTraceServiceResponse,
)
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from consumer.cli.producer import PublishRequest, publish_event
from consumer.observe.otel import OtelTracing
from consumer.observe.traceparent import read_traceparent
from consumer.service.components import broker_config
from tests.servers import free_port
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    queue_depth,
    run_cli,
    wait_until,
)

_CONSUMER, _PRODUCER, _INTERNAL = 5, 4, 1  # OTLP's span kinds
_OK, _ERROR = 1, 2


@dataclass(frozen=True)
class Span:
    name: str
    trace_id: str
    span_id: str
    parent_id: str
    kind: int
    status: int
    attributes: dict[str, Any]


class Collector:
    """An OTLP/HTTP trace receiver: the spans the processes export to it."""

    def __init__(self) -> None:
        self.spans: list[Span] = []
        self.port = free_port()

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def receive(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        export = ExportTraceServiceRequest.FromString(await request.read())
        for resource in export.resource_spans:
            for scope in resource.scope_spans:
                for span in scope.spans:
                    self.spans.append(
                        Span(
                            name=span.name,
                            trace_id=span.trace_id.hex(),
                            span_id=span.span_id.hex(),
                            parent_id=span.parent_span_id.hex(),
                            kind=span.kind,
                            status=span.status.code,
                            attributes={
                                a.key: getattr(
                                    a.value, a.value.WhichOneof("value") or "string_value"
                                )
                                for a in span.attributes
                            },
                        )
                    )
        body = ExportTraceServiceResponse().SerializeToString()
        return aiohttp.web.Response(body=body, content_type="application/x-protobuf")

    def of(self, trace_id: str) -> list[Span]:
        return [span for span in self.spans if span.trace_id == trace_id]

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` with the OTEL_* variables that send a process's spans here, quickly."""
        return {
            **base,
            "OTEL_EXPORTER_OTLP_ENDPOINT": self.endpoint,
            "OTEL_BSP_SCHEDULE_DELAY": "100",
            "OTEL_SERVICE_NAME": "consumer-under-test",
        }


@pytest.fixture
async def collector() -> AsyncIterator[Collector]:
    receiver = Collector()
    app = aiohttp.web.Application()
    app.router.add_post("/v1/traces", receiver.receive)
    runner = aiohttp.web.AppRunner(app)
    await runner.setup()
    await aiohttp.web.TCPSite(runner, "127.0.0.1", receiver.port).start()
    yield receiver
    await runner.cleanup()


@pytest.fixture
def producer_spans() -> list[ReadableSpan]:
    return []


async def traced_publish(
    env: TestEnv, exported: list[ReadableSpan], request: PublishRequest
) -> tuple[uuid.UUID, str]:
    """Publish as ``consumer publish`` does, traced in this process (each publish a tracer of
    its own, closed after it, as the command's is): the event id and the publish span's id."""
    memory = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(memory))
    tracing = OtelTracing(provider.get_tracer("test-producer"), provider)
    settings = env.settings()
    event_id = await publish_event(
        broker_config(settings), settings.exchange, request, tracing=tracing
    )
    (span,) = memory.get_finished_spans()
    tracing.close()
    exported.append(span)
    assert span.context is not None
    return event_id, f"{span.context.span_id:016x}"


async def start_traced_service(env: TestEnv, collector: Collector, **overrides: str) -> None:
    await env.apply_topology(**overrides)
    service = ServiceProcess(env, **overrides)
    service.environment = collector.environment(service.environment)
    await service.start().wait_ready()


def ancestors(span: Span, by_id: dict[str, Span]) -> list[str]:
    chain = []
    while span.parent_id:
        chain.append(span.parent_id)
        if span.parent_id not in by_id:
            break
        span = by_id[span.parent_id]
    return chain


async def test_one_trace_from_the_publish_through_two_retries_to_the_commit(
    env: TestEnv, collector: Collector, producer_spans: list[ReadableSpan]
) -> None:
    # Given a traced service, and an event that fails twice before it commits
    await start_traced_service(env, collector)
    request = PublishRequest(
        "test.behave", payload=behave("traced", fail_transient=2), correlation_id="order-7"
    )

    # When it is published with a trace
    event_id, publish_id = await traced_publish(env, producer_spans, request)
    (published,) = producer_spans
    trace_id = f"{published.context.trace_id:032x}"

    async def three_processed() -> bool:
        done = [s for s in collector.of(trace_id) if s.kind == _CONSUMER]
        return len(done) == 3 and sum(s.name == "transaction" for s in collector.of(trace_id)) == 3

    await wait_until(three_processed, what="three process spans and their transactions")

    # Then one trace: the publish is the ancestor of the three process spans and the two
    # retry copies' publish spans, each delivery the child of the copy it came as
    assert published.kind.name == "PRODUCER"
    assert published.attributes is not None
    assert published.attributes["messaging.system"] == "rabbitmq"
    assert published.attributes["messaging.destination.name"] == env.settings().exchange
    spans = collector.of(trace_id)
    by_id = {span.span_id: span for span in spans}
    processes = [s for s in spans if s.kind == _CONSUMER]
    retries = [s for s in spans if s.kind == _PRODUCER]
    assert len(retries) == 2
    for span in [*processes, *retries]:
        assert publish_id in ancestors(span, by_id), span
    chain = [next(s for s in processes if s.parent_id == publish_id)]
    for _ in range(2):
        copy = next(r for r in retries if r.parent_id == chain[-1].span_id)
        assert copy.name == f"publish {env.names.retry}"
        chain.append(next(s for s in processes if s.parent_id == copy.span_id))
    assert [s.attributes["consumer.outcome"] for s in chain] == ["retried", "retried", "processed"]
    assert [s.attributes["consumer.attempt"] for s in chain] == [0, 1, 2]
    assert [s.status for s in chain] == [_ERROR, _ERROR, _OK]
    for span in chain:
        assert span.name == f"process {env.names.work}"
        assert span.attributes["messaging.system"] == "rabbitmq"
        assert span.attributes["messaging.operation.type"] == "process"
        assert span.attributes["messaging.message.id"] == str(event_id)
        assert span.attributes["messaging.message.conversation_id"] == "order-7"
    # ... and the transaction that committed is inside the last one
    (committed,) = [s for s in spans if s.name == "transaction" and s.status != _ERROR]
    assert committed.parent_id == chain[-1].span_id
    assert committed.kind == _INTERNAL
    await assert_applied_once(env.database_url, [event_id])

    # And each "message settled" line names the trace and the correlation id
    (service,) = env.processes
    settled = [line for line in service.log_lines() if line.get("event") == "message settled"]
    assert [line["outcome"] for line in settled] == ["retried", "retried", "processed"]
    assert {line["trace_id"] for line in settled} == {trace_id}
    assert {line["correlation_id"] for line in settled} == {"order-7"}


async def test_dead_letters_carry_the_trace_and_a_replay_continues_it(
    env: TestEnv, collector: Collector, producer_spans: list[ReadableSpan]
) -> None:
    # Given a traced service with one retry, and two traced events: a poison message, and an
    # event that fails twice (its retry exhausted, then dead-lettered)
    await start_traced_service(env, collector, retry_delays="200ms")
    _, poison_id = await traced_publish(
        env, producer_spans, PublishRequest("test.behave", raw_body=b"<not json/>")
    )
    event_id, _ = await traced_publish(
        env,
        producer_spans,
        PublishRequest("test.behave", payload=behave("later", fail_transient=2)),
    )
    poison_trace, event_trace = (f"{span.context.trace_id:032x}" for span in producer_spans)

    async def two_dead() -> bool:
        return await queue_depth(env.amqp_url, env.names.dead) == 2

    await wait_until(two_dead, what="two dead letters")

    # Then each dead letter carries its trace on, in the producer's trace: the context of the
    # service's dead-letter publish (poison too is a copy the service publishes)
    letters = await drain_queue(env.amqp_url, env.names.dead, ack=False)
    parents = [read_traceparent(letter.headers) for letter in letters]
    assert all(parent is not None for parent in parents)
    by_trace = {f"{p.trace_id:032x}": p for p in parents if p is not None}
    assert f"{by_trace[poison_trace].span_id:016x}" != poison_id
    for trace in (poison_trace, event_trace):

        async def dead_letter_published(trace: str = trace) -> bool:
            return any(s.name == f"publish {env.names.dlx}" for s in collector.of(trace))

        await wait_until(dead_letter_published, what="the dead-letter publish span")
        dead_copy = next(s for s in collector.of(trace) if s.name == f"publish {env.names.dlx}")
        assert f"{by_trace[trace].span_id:016x}" == dead_copy.span_id

    # When the operator replays the event, tracing on
    replayed = run_cli(
        "consumer", "dlq", "replay", str(event_id), env=collector.environment(env.env())
    )
    assert replayed.returncode == 0, replayed.stderr

    # Then the replay and the delivery that commits continue the same trace
    async def committed() -> bool:
        return any(
            s.kind == _CONSUMER and s.attributes.get("consumer.outcome") == "processed"
            for s in collector.of(event_trace)
        )

    await wait_until(committed, what="the replayed event's process span")
    spans = collector.of(event_trace)
    replay = next(s for s in spans if s.kind == _PRODUCER and s.parent_id == dead_copy.span_id)
    assert replay.name == f"publish {env.settings().exchange}"
    last = next(s for s in spans if s.attributes.get("consumer.outcome") == "processed")
    assert last.parent_id == replay.span_id
    assert any(s.name == "transaction" and s.parent_id == last.span_id for s in spans)
    await assert_applied_once(env.database_url, [event_id])
    assert last.attributes["consumer.attempt"] == 0
