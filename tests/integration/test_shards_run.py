"""``consumer run`` with a sharded queue (issue 36, step 2), on the real broker and database: every
shard is consumed (or, with ``--shards``, those named: replicas split them), each event with a
key published through the ingress is applied exactly once, a retried event comes back to its own
shard and is applied once, and a permanent failure lands in the queue's one dead-letter queue
naming its shard. No timed assertion: rows and depths, waited for."""

from __future__ import annotations

import uuid
from pathlib import Path

from consumer.amqp import headers as h
from consumer.cli.producer import envelope_body
from tests.servers import free_port
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    fetchval,
    queue_consumers,
    queue_depth,
    run_cli,
    wait_until,
)
from topology.names import SHARD, SHARD_KEY

SHARDS = 3
KEYS = 12
PER_KEY = 5

TABLE = f"""
[queues.work]
types = ["test.behave", "test.behave_many", "test.odd"]
shards = {SHARDS}
prefetch = 10

[queues.other]
types = ["inventory.restock", "inventory.reserve", "notification.requested"]
"""


def shard_names(env: TestEnv) -> list[str]:
    return [f"{env.name}.work.work.s{i}" for i in range(1, SHARDS + 1)]


async def publish(env: TestEnv, key: str, **spec: object) -> uuid.UUID:
    """A ``test.behave`` event through the ingress, hashed on its key as a producer sets it."""
    event_id = uuid.uuid4()
    body = envelope_body("test.behave", behave(key, **spec), event_id=event_id)
    async with env.producer() as producer:
        await producer.send_raw(body, "test.behave", headers={SHARD_KEY: key})
    return event_id


async def effects(env: TestEnv) -> int:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects"))


async def test_every_shard_is_consumed_and_each_event_applied_once(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table whose work queue has 3 shards, applied, and events of 12 keys published
    # through the ingress before any consumer runs: one that fails twice (transiently), and one
    # that fails transiently once, then for good
    env.use_queue_table(TABLE, tmp_path)
    applied = run_cli("topology", "apply", env=env.env())
    assert applied.returncode == 0, applied.stderr
    events = [await publish(env, f"k{n % KEYS}") for n in range(KEYS * PER_KEY)]
    retried = await publish(env, "retried", fail_transient=2)
    doomed = await publish(env, "doomed", fail_transient=1, permanent=True)
    waiting = [await queue_depth(env.amqp_url, shard) for shard in shard_names(env)]
    assert sum(waiting) == len(events) + 2
    assert all(depth > 0 for depth in waiting), waiting

    # When the service runs the table
    service = await ServiceProcess(env).start().wait_ready()

    # Then it consumes every shard, and applies every event but the doomed one exactly once,
    # the retried one included: one receipt each
    for shard in shard_names(env):
        assert await queue_consumers(env.amqp_url, shard) == 1, shard

    async def all_applied() -> bool:
        return await effects(env) == len(events) + 1

    await wait_until(all_applied, timeout=90, what="every event applied")
    await assert_applied_once(env.database_url, [*events, retried])
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == len(events) + 1
    calls = "SELECT count(*) FROM handler_calls WHERE event_id = $1"
    assert await fetchval(env.database_url, calls, retried) == 3

    # And the doomed one, retried once, is in the queue's one dead-letter queue, naming a shard
    dead = f"{env.name}.work.dead"

    async def dead_lettered() -> bool:
        return await queue_depth(env.amqp_url, dead) == 1

    await wait_until(dead_lettered, timeout=30, what="the permanent failure dead-lettered")
    assert await fetchval(env.database_url, calls, doomed) == 2

    async def shards_empty() -> bool:
        return all([await queue_depth(env.amqp_url, shard) == 0 for shard in shard_names(env)])

    await wait_until(shards_empty, timeout=30, what="every shard drained")
    assert await service.stop() == 0
    (letter,) = await drain_queue(env.amqp_url, dead)
    headers = letter.headers
    assert headers[h.REASON] == "permanent_failure"
    assert headers[h.ATTEMPT] == 1

    # And its retry came back to its key's shard: the shard the dead letter names (the one its
    # second delivery came from) is where the key goes, seen by publishing it once more
    await publish(env, "doomed")
    depths = [await queue_depth(env.amqp_url, shard) for shard in shard_names(env)]
    assert sorted(depths) == [0] * (SHARDS - 1) + [1], depths
    assert headers[SHARD] == f"s{depths.index(1) + 1}"
    await drain_queue(env.amqp_url, shard_names(env)[depths.index(1)])


async def test_replicas_split_the_shards_with_shards(env: TestEnv, tmp_path: Path) -> None:
    # Given the table applied, and events of 12 keys waiting in its shards
    env.use_queue_table(TABLE, tmp_path)
    applied = run_cli("topology", "apply", env=env.env())
    assert applied.returncode == 0, applied.stderr
    events = [await publish(env, f"k{n % KEYS}") for n in range(KEYS * PER_KEY)]

    # When one replica runs shards 1 and 3, and another shard 2
    one = await ServiceProcess(env, "one", run_args=("--shards", "1,3")).start().wait_ready()
    s1, s2, s3 = shard_names(env)
    assert [await queue_consumers(env.amqp_url, shard) for shard in (s1, s2, s3)] == [1, 0, 1]

    async def s2_only_left() -> bool:
        return (await queue_depth(env.amqp_url, s1), await queue_depth(env.amqp_url, s3)) == (0, 0)

    await wait_until(s2_only_left, timeout=60, what="shards 1 and 3 drained")
    assert await queue_depth(env.amqp_url, s2) > 0
    port = str(free_port())
    two = ServiceProcess(env, "two", run_args=("--shards", "2"), HTTP_PORT=port)
    await two.start().wait_ready()

    # Then between them every event is applied exactly once
    async def all_applied() -> bool:
        return await effects(env) == len(events)

    await wait_until(all_applied, timeout=90, what="every event applied")
    await assert_applied_once(env.database_url, events)
    assert await one.stop() == 0
    assert await two.stop() == 0


def test_a_shard_the_table_has_not_stops_run_with_one_line(env: TestEnv, tmp_path: Path) -> None:
    env.use_queue_table(TABLE, tmp_path)

    result = run_cli("consumer", "run", "--shards", "2,5", env=env.env())

    assert result.returncode == 2
    assert result.stderr.splitlines() == ["error: --shards: queue work has shards 1 to 3, not 5"]
