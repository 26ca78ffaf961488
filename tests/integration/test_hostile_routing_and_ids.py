"""What a producer cannot do with the routing key: have another type's event applied under its own
routing key.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

from consumer.producer import envelope_body
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetchval,
    queue_depth,
    run_cli,
    wait_until,
)

NOTIFY = "notification.requested"
NOTE = {"recipient": "someone@example.test", "template": "t"}


async def _dead_at_least(env: TestEnv, expected: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.dead) >= expected


async def _effects_at_least(env: TestEnv, expected: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) >= expected


def dlq(env: TestEnv, *args: str) -> tuple[int, str, str]:
    result = run_cli("consumer", "dlq", *args, env=env.env())
    return result.returncode, result.stdout, result.stderr


def dlq_letters(env: TestEnv) -> dict[str, dict[str, Any]]:
    code, out, err = dlq(env, "list", "--json")
    assert code == 0, err
    return {row["id"]: row for row in map(json.loads, out.splitlines())}


# -- the routing key is the type ------------------------------------------------------------------


async def test_a_type_under_another_types_routing_key_is_poison_and_retries_and_replays_pass(
    env: TestEnv,
) -> None:
    # Given the service, and a producer whose topic permission allows only notification.*
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()

    # When it publishes a restock of 500 under notification.requested, among events that climb
    # the retry ladder (back to the work queue by a rung's dead-lettering) or are dead-lettered
    # for good and then replayed
    forged = uuid.uuid4()
    async with env.producer() as producer:
        await producer.send_raw(
            envelope_body("inventory.restock", {"sku": "SKU-1", "qty": 500}, event_id=forged),
            NOTIFY,
        )
        flaky = await producer.send("test.behave", behave("flaky", fail_transient=2))
        phoenix = await producer.send("test.behave", behave("phoenix", fail_transient=4))
    await wait_until(lambda: _effects_at_least(env, 1), what="the flaky event, after two retries")
    await wait_until(lambda: _dead_at_least(env, 2), what="the forged one and the phoenix dead")
    code, out, err = dlq(env, "replay", str(phoenix))
    assert code == 0, err
    await wait_until(lambda: _effects_at_least(env, 2), what="the phoenix, replayed")

    # Then the restock is poison, routing_key_mismatch, and the stock never moved
    assert await fetchval(env.database_url, "SELECT count(*) FROM stock_movements") == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM stock") == 0
    letters = dlq_letters(env)
    assert letters[str(forged)]["reason"] == "routing_key_mismatch"
    assert "'inventory.restock'" in letters[str(forged)]["error"]
    reason = {"reason": "routing_key_mismatch"}
    assert await service.metric("consumer_dead_letters_total", **reason) == 1
    # And the retried and the replayed events passed the check: each applied once
    await assert_applied_once(env.database_url, [flaky, phoenix])
    assert await service.metric("consumer_retries_published_total", rung="200ms") == 2
    # And a replay keeps the forged letter unless forced: it would go out under its own type
    code, out, err = dlq(env, "replay", str(forged))
    assert code == 1
    assert "routing_key_mismatch" in err
    assert await queue_depth(env.amqp_url, env.names.dead) == 1
    code, out, err = dlq(env, "replay", "--all", "--dry-run")
    assert f"would keep   {forged}: routing_key_mismatch" in out
    assert await service.stop() == 0
