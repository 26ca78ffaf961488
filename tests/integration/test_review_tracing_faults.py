"""Tracing must never cost an event: a span processor that raises (the SDK calls processors
without catching what they raise) and an exporter whose collector is down, in a real service.
Injected by tests/handlers/sabotage.py (``span_hooks``)."""

from __future__ import annotations

from tests.servers import free_port
from tests.support import (
    TEST_HANDLERS,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetchval,
    queue_depth,
    wait_until,
)

HANDLERS = f"{TEST_HANDLERS},tests.handlers.sabotage"


async def test_a_span_processor_that_raises_costs_no_event_and_no_worker(env: TestEnv) -> None:
    # Given a traced service whose every span start and end raises, exporting to a collector
    # that is not there
    env.overrides["handlers"] = HANDLERS
    await env.apply_topology()
    service = ServiceProcess(env, "traced")
    service.environment.update(
        TEST_SABOTAGE="span_hooks",
        OTEL_TRACES_EXPORTER="otlp",
        OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{free_port()}",
        OTEL_BSP_SCHEDULE_DELAY="100",
    )
    await service.start().wait_ready()

    # When events come that are applied at once, after a retry, and dead-lettered
    async with env.producer() as producer:
        applied = [await producer.send("test.sabotage", {"key": f"k{n}"}) for n in range(5)]
        retried = await producer.send("test.behave", behave("retried", fail_transient=1))
        await producer.send("test.behave", behave("dead", permanent=True))

    # Then each is settled as if tracing were off: applied once, or dead-lettered
    async def all_settled() -> bool:
        effects = int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects"))
        return effects >= 6 and await queue_depth(env.amqp_url, env.names.dead) >= 1

    await wait_until(all_settled, what="every event applied or dead-lettered")
    await assert_applied_once(env.database_url, [*applied, retried])
    assert await queue_depth(env.amqp_url, env.names.dead) == 1

    # And the service is still running, its workers alive, nothing left unacked
    assert service.running, service.log_tail()
    died = [
        line
        for line in service.log_lines()
        if line.get("event") == "a worker stopped on an unexpected error"
    ]
    assert not died
    failures = [line for line in service.log_lines() if "tracing:" in str(line.get("event"))]
    assert failures, "a tracing failure is logged"
    await env.assert_settled()
