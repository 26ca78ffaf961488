"""``python -m consumer publish``: one event by hand, as producers should send it."""

from __future__ import annotations

import json
import shlex
import uuid
from datetime import UTC, datetime

from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    drain_queue,
    fetchval,
    run_cli,
    wait_until,
)


def publish(
    env: TestEnv, event_type: str, payload: dict[str, object], event_id: uuid.UUID, *more: str
) -> str:
    result = run_cli(
        "consumer",
        *("publish", "--type", event_type, "--payload", json.dumps(payload)),
        *("--event-id", str(event_id), *more),
        env=env.env(),
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


async def test_publish_with_an_event_id_sends_that_id_and_twice_applies_once(env: TestEnv) -> None:
    # Given the topology, and no service running yet
    await env.apply_topology()
    event_id = uuid.uuid4()

    # When one event is published by hand with its id and time, twice (a retrying producer)
    occurred = datetime.now(UTC).isoformat()
    printed = [
        publish(env, "test.behave", {"key": "by-hand"}, event_id, "--occurred-at", occurred)
        for _ in range(2)
    ]

    # Then both messages carry that id, persistent, as JSON, routed by their type
    assert printed == [str(event_id)] * 2
    messages = await drain_queue(env.amqp_url, env.names.work, ack=False)
    assert len(messages) == 2
    for message in messages:
        envelope = json.loads(message.body)
        assert envelope["event_id"] == str(event_id)
        assert envelope["type"] == "test.behave"
        assert envelope["payload"] == {"key": "by-hand"}
        assert message.routing_key == "test.behave"
        assert message.content_type == "application/json"
        assert message.delivery_mode == 2

    # And the service applies it once: the second copy is a duplicate
    service = await ServiceProcess(env).start().wait_ready()

    async def both_settled() -> bool:
        counted = [
            await service.metric("consumer_messages_total", type="test.behave", outcome=outcome)
            for outcome in ("processed", "duplicate")
        ]
        return counted == [1, 1]

    await wait_until(both_settled, what="one copy processed and one duplicate")
    await assert_applied_once(env.database_url, [event_id])
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 1


async def test_a_payload_its_schema_refuses_is_not_sent(env: TestEnv) -> None:
    # Given the topology
    await env.apply_topology()

    # When a payload the restock handler's model refuses is published, then with --no-check
    refused = run_cli(
        "consumer",
        *("publish", "--type", "inventory.restock", "--payload", '{"sku": "S-1", "qty": 0}'),
        env=env.env(),
    )
    forced = run_cli(
        "consumer",
        *("publish", "--type", "inventory.restock", "--payload", '{"sku": "S-1", "qty": 0}'),
        "--no-check",
        env=env.env(),
    )

    # Then the first is refused in one line naming the field, and only the second is sent
    assert refused.returncode == 2
    assert refused.stdout == ""
    assert refused.stderr.startswith("error: inventory.restock payload refused by its schema: qty")
    assert len(refused.stderr.strip().splitlines()) == 1
    assert forced.returncode == 0, forced.stderr
    messages = await drain_queue(env.amqp_url, env.names.work, ack=True)
    assert [json.loads(m.body)["payload"] for m in messages] == [{"sku": "S-1", "qty": 0}]


async def test_publish_prints_the_command_that_sends_the_same_event_again(env: TestEnv) -> None:
    # Given the topology
    await env.apply_topology()

    # When an event is published, then again with the command it printed on stderr
    first = run_cli(
        "consumer",
        *("publish", "--type", "test.behave", "--payload", '{"key": "it\'s again"}'),
        *("--correlation-id", "c-1"),
        env=env.env(),
    )
    assert first.returncode == 0, first.stderr
    prefix = "to publish it again: "
    [line] = [line for line in first.stderr.splitlines() if line.startswith(prefix)]
    argv = shlex.split(line.removeprefix(prefix))
    assert argv[:2] == ["consumer", "publish"]
    again = run_cli(*argv, env=env.env())

    # Then both messages are the same event: same id, time, payload and correlation id
    assert again.returncode == 0, again.stderr
    assert again.stdout == first.stdout
    messages = await drain_queue(env.amqp_url, env.names.work, ack=True)
    envelopes = [json.loads(message.body) for message in messages]
    assert len(envelopes) == 2
    assert envelopes[0] == envelopes[1]
    assert envelopes[0]["event_id"] == first.stdout.strip()
    assert envelopes[0]["payload"] == {"key": "it's again"}
    assert envelopes[0]["correlation_id"] == "c-1"
