"""Found in review, now a regression test. The defect was: a payload validator that blocks the event
loop escapes crash attribution.

Parsing (the handler's payload model) runs in ``Service._route`` (the AMQP delivery callback's
task) and, for a redelivered delivery, in ``Pipeline.process_isolated`` *before* the mark is written
and outside any registered ``HandlerCall``: the watchdog convicts nobody, no mark is left, and
every death returns every delivery the process held. A supervisor restarts the service each
time, as the chaos suite does; the culprit is only stopped by the broker's delivery limit, and
the innocent events held with it each time reach that limit too.
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections import Counter
from typing import Any

import pytest

from tests.support import (
    TEST_HANDLERS,
    Producer,
    ServiceProcess,
    TestEnv,
    behave,
    drain_queue,
    fetch,
    queue_depth,
)


@pytest.fixture
def own(env: TestEnv) -> TestEnv:
    """The test's env with these handlers (its ingress exchange, `<name>.events`, is the env's own
    and goes with its topology)."""
    env.overrides["handlers"] = f"{TEST_HANDLERS},tests.handlers.review"
    return env


async def test_a_blocking_payload_validator_is_named_and_dead_lettered_alone(
    own: TestEnv,
) -> None:
    env = own
    limits = {"handler_timeout": "500ms", "hard_timeout": "1500ms", "prefetch": "50"}
    await env.apply_topology(**limits)
    culprit = uuid.uuid4()
    innocents = [uuid.uuid4() for _ in range(30)]
    async with Producer(env.amqp_url, env.settings().exchange) as producer:
        await producer.send(
            "review.slow_validator", {"key": "c", "name": "x", "block_s": 5}, event_id=culprit
        )
        await producer.send_many(
            ("test.behave", behave(f"i{n}"), i) for n, i in enumerate(innocents)
        )

    exits: list[int | None] = []
    convicted: list[object] = []
    for run in range(10):
        service = ServiceProcess(env, f"run{run}", **limits).start()
        for _ in range(200):
            if service.returncode is not None:
                break
            if (
                await queue_depth(env.amqp_url, env.names.work) == 0
                and await service.is_ready()
                and await service.metric("consumer_in_flight") == 0
            ):
                break
            await asyncio.sleep(0.1)
        if service.returncode is None:
            await service.stop()
            exits.append(service.returncode)
            break
        exits.append(service.returncode)
        convicted += [
            x.get("convicted") for x in service.log_lines() if x.get("level") == "critical"
        ]

    letters = await drain_queue(env.amqp_url, env.names.dead)
    reasons: Counter[str] = Counter()
    dead_innocents = 0
    for letter in letters:
        event_id = uuid.UUID(json.loads(letter.body)["event_id"])
        headers: dict[str, Any] = dict(letter.headers or {})
        deaths: Any = headers.get("x-death") or [{}]
        reason = headers.get("consumer-dead-reason") or deaths[0].get("reason")
        reasons[str(reason)] += 1
        dead_innocents += event_id in innocents
    applied = {
        row["event_id"]
        for row in await fetch(env.database_url, "SELECT event_id FROM test_effects")
    }
    print(f"exits={exits} convicted={convicted} dead={dict(reasons)}")
    print(f"innocents applied={len(applied & set(innocents))} dead-lettered={dead_innocents}")
    # Expected by the design: the culprit is named (hard_time_limit) after one death, and every
    # innocent is applied.
    assert dead_innocents == 0, f"{dead_innocents} innocent events dead-lettered"
    assert reasons.get("hard_time_limit") == 1, f"culprit not convicted: {dict(reasons)}"
