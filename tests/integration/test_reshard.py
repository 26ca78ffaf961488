"""Resharding (issue 36, step 3): ``consumer topology migrate`` from a table whose queue has N
shards to one where it has M, on the real broker and database.

Under load (keyed events published through the ingress, some failing twice so that the ladder
holds them as the bindings move) while a real ``consumer run`` consumes and rolls over: 3 shards
to 5, then 5 to 2; every event applied exactly once, nothing dead-lettered, the leaving shards
gone. Without consumers: what leaving shards hold goes to the shard its key has now, and a retry
of a removed shard too. No timed assertion: rows, receipts and queue depths, waited for."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterable
from pathlib import Path

from consumer.cli.producer import envelope_body
from consumer.cli.topology.migrate import EXIT_PENDING
from consumer.config.queue_table import read_queue_table
from consumer.service.components import table_topology
from tests.servers import free_port
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    drain_queue,
    fetchval,
    queue_depth,
    queue_exists,
    run_cli,
    wait_until,
)
from topology.names import RETRY_RUNG, SHARD, SHARD_KEY

KEYS = 40


def table(shards: int) -> str:
    return f"""
[queues.work]
types = ["test.behave", "test.behave_many", "test.odd"]
shards = {shards}
prefetch = 10
retry_delays = "200ms,1s"

[queues.other]
types = ["inventory.restock", "inventory.reserve", "notification.requested"]
"""


def tables(env: TestEnv, tmp_path: Path, *counts: int) -> list[Path]:
    """The table with each shard count, the first in use and applied; each one's topology is
    removed with the test's (its shards too)."""
    first, *rest = counts
    paths = [env.use_queue_table(table(first), tmp_path)]
    for count in rest:
        path = tmp_path / f"queues-{count}.toml"
        path.write_text(table(count))
        env.topologies.append(table_topology(read_queue_table(path, env.settings())))
        paths.append(path)
    applied = run_cli("consumer", "topology", "apply", env=env.env())
    assert applied.returncode == 0, applied.stdout + applied.stderr
    return paths


def shard(env: TestEnv, number: int) -> str:
    return f"{env.name}.work.work.s{number}"


def shards(env: TestEnv, numbers: Iterable[int]) -> list[str]:
    return [shard(env, number) for number in numbers]


async def migrate(env: TestEnv, old: Path, new: Path, *more: str) -> tuple[int, str]:
    result = await asyncio.to_thread(
        run_cli,
        "consumer",
        "topology",
        "migrate",
        f"--from-queues-file={old}",
        *more,
        env=env.env(queues_file=str(new)),
        timeout=180,
    )
    return result.returncode, result.stdout + result.stderr


async def effects(env: TestEnv) -> int:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects"))


class _KeyedLoad:
    """``test.behave`` events of :data:`KEYS` keys through the ingress, each with its shard key
    as a producer sets it, paced, until told to stop; one in eight fails twice (transiently)."""

    def __init__(self, env: TestEnv) -> None:
        self.env = env
        self.events: list[uuid.UUID] = []
        self.stop = asyncio.Event()

    async def run(self) -> None:
        async with self.env.producer() as producer:
            number = 0
            while not self.stop.is_set() or len(self.events) < 1000:
                sends = []
                for _ in range(20):
                    key = f"k{number % KEYS}"
                    failing = 2 if number % 8 == 0 else 0
                    event_id = uuid.uuid4()
                    body = envelope_body(
                        "test.behave", behave(key, fail_transient=failing), event_id=event_id
                    )
                    sends.append(producer.send_raw(body, "test.behave", headers={SHARD_KEY: key}))
                    self.events.append(event_id)
                    number += 1
                await asyncio.gather(*sends)
                await asyncio.sleep(0.1)


async def test_resharding_3_to_5_to_2_under_load_applies_every_event_once(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given the service on a table whose queue has 3 shards, under keyed load
    three, five, two = tables(env, tmp_path, 3, 5, 2)
    on_three = await ServiceProcess(env, "three").start().wait_ready()
    load = _KeyedLoad(env)
    publishing = asyncio.create_task(load.run())

    async def started() -> bool:
        return await effects(env) >= 100

    await wait_until(started, timeout=60, what="the load to start")

    # When the queue goes to 5 shards while the 3-shard service runs
    code, output = await migrate(env, three, five)

    # Then the migration adds s4 and s5, moves and deletes nothing, and is done at once
    assert code == 0, output
    assert f"declare queue {shard(env, 5)}" in output
    assert "move the messages" not in output
    assert "migrated: the queue table's plan is in place" in output

    # When the service rolls over to 5 shards, and the queue goes to 2 while it runs
    on_five = ServiceProcess(env, "five", http_port=str(free_port()), queues_file=str(five))
    await on_five.start().wait_ready()
    assert await on_three.stop() == 0
    code, output = await migrate(env, five, two)

    # Then the migration moves what the leaving shards hold, and waits for their consumer
    assert code == EXIT_PENDING, output
    assert f"move the messages of {shard(env, 5)} to exchange {env.name}.work.redeliver" in output
    assert (
        f"pending: {shard(env, 5)} still has 1 consumers (replicas on the old settings): roll "
        "them out, then run the migration again"
    ) in output

    # When the service rolls over to 2 shards, and the migration runs again
    on_two = ServiceProcess(env, "two", http_port=str(free_port()), queues_file=str(two))
    await on_two.start().wait_ready()
    assert await on_five.stop() == 0
    code, output = await migrate(env, five, two)
    load.stop.set()
    await publishing

    # Then it is done, and the leaving shards are gone
    assert code == 0, output
    assert "migrated: the queue table's plan is in place" in output
    for gone in shards(env, (3, 4, 5)):
        assert not await queue_exists(env.amqp_url, gone), gone

    # And every event is applied exactly once, through whichever shard it came
    async def all_applied() -> bool:
        return await effects(env) >= len(load.events)

    await wait_until(all_applied, timeout=240, what="every event applied")
    await assert_applied_once(env.database_url, load.events)
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == len(load.events)

    # And nothing is dead, nothing is left in a shard, and the topology is the plan's
    assert await queue_depth(env.amqp_url, f"{env.name}.work.dead") == 0

    async def drained() -> bool:
        return all([await queue_depth(env.amqp_url, q) == 0 for q in shards(env, (1, 2))])

    await wait_until(drained, timeout=60, what="the shards drained")
    assert await on_two.stop() == 0
    check = run_cli("consumer", "topology", "check", env=env.env(queues_file=str(two)))
    assert check.returncode == 0, check.stdout + check.stderr


async def _publish_keys(env: TestEnv, keys: Iterable[str], each: int) -> None:
    async with env.producer() as producer:
        for key in keys:
            for _ in range(each):
                body = envelope_body("test.behave", behave(key), event_id=uuid.uuid4())
                await producer.send_raw(body, "test.behave", headers={SHARD_KEY: key})


async def _retry_of(env: TestEnv, label: str, key: str) -> None:
    """A retry copy of shard ``label`` at the end of its rung: into the redeliver exchange."""
    async with env.producer() as producer:
        body = envelope_body("test.behave", behave(key), event_id=uuid.uuid4())
        await producer.send_raw(
            body,
            "test.behave",
            headers={SHARD: label, SHARD_KEY: key},
            exchange=f"{env.name}.work.redeliver",
        )


async def _keys_by_shard(env: TestEnv, numbers: Iterable[int]) -> dict[str, set[str]]:
    """Each shard's messages taken, by the shard key they carry."""
    found: dict[str, set[str]] = {}
    for queue in shards(env, numbers):
        messages = await drain_queue(env.amqp_url, queue)
        found[queue] = {str(message.headers[SHARD_KEY]) for message in messages}
    return found


async def test_what_leaving_shards_hold_goes_to_the_shard_its_key_has_now(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a queue of 4 shards holding events of 30 keys, 3 each, and no consumer
    four, two = tables(env, tmp_path, 4, 2)
    keys = [f"key-{n}" for n in range(30)]
    await _publish_keys(env, keys, 3)
    held = [await queue_depth(env.amqp_url, queue) for queue in shards(env, range(1, 5))]
    assert sum(held) == 90
    assert held[2] + held[3] > 0, held

    # When the dry run, then the migration, take it to 2 shards
    dry_code, dry = await migrate(env, four, two, "--dry-run")
    code, output = await migrate(env, four, two)

    # Then the dry run lists the reshard's steps, the last shard unbound first
    assert dry_code == 0, dry
    assert dry.splitlines()[:3] == [
        f" {n}. bind {env.name}.work.redeliver -> {env.name}.work.hash where "
        f"{{'x-match': 'all', 'consumer-shard': 's{shard_number}'}} (exchange)"
        for n, shard_number in ((1, 4), (2, 3))
    ] + [f" 3. unbind {env.name}.work.hash -> {shard(env, 4)} with routing key '1'"]

    # And the migration moves what s3 and s4 held, deletes them, and loses nothing
    assert code == 0, output
    assert f"move the messages of {shard(env, 4)}" in output
    assert not await queue_exists(env.amqp_url, shard(env, 3))
    assert not await queue_exists(env.amqp_url, shard(env, 4))
    assert sum([await queue_depth(env.amqp_url, q) for q in shards(env, (1, 2))]) == 90

    # And each key's events are in one shard: the one its key goes to now, as a new event of
    # each key shows
    before = await _keys_by_shard(env, (1, 2))
    assert not before[shard(env, 1)] & before[shard(env, 2)]
    assert before[shard(env, 1)] | before[shard(env, 2)] == set(keys)
    await _publish_keys(env, keys, 1)
    assert await _keys_by_shard(env, (1, 2)) == before

    # And a retry of a removed shard (an old replica's, or one in a rung) goes to its key's shard
    await _retry_of(env, "s4", keys[0])
    home = next(queue for queue, found in before.items() if keys[0] in found)
    assert await queue_depth(env.amqp_url, home) == 1
    assert len(await drain_queue(env.amqp_url, home)) == 1

    # When it is rolled back to 4 shards
    code, output = await migrate(env, four, two, "--rollback")

    # Then s3 and s4 are back, the redirects gone: a retry of s4 returns to s4 alone
    assert code == 0, output
    await _retry_of(env, "s4", keys[0])
    depths = [await queue_depth(env.amqp_url, q) for q in shards(env, range(1, 5))]
    assert depths == [0, 0, 0, 1]


async def test_apply_of_more_shards_after_a_reshard_to_fewer_removes_the_redirect(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a queue taken from 3 shards to 2 by the migration: a retry of s3 goes to the hash
    three, two = tables(env, tmp_path, 3, 2)
    code, output = await migrate(env, three, two)
    assert code == 0, output

    # When the table goes back to 3 shards by apply, not by the migration
    applied = run_cli("consumer", "topology", "apply", env=env.env(queues_file=str(three)))

    # Then a retry of s3 comes back to s3 alone, not hashed as well
    assert applied.returncode == 0, applied.stdout + applied.stderr
    await _retry_of(env, "s3", "k")
    depths = [await queue_depth(env.amqp_url, q) for q in shards(env, range(1, 4))]
    assert depths == [0, 0, 1]


async def test_a_reshard_from_fewer_shards_than_the_broker_has_is_refused(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a queue of 4 shards on the broker (as a migration from 4 to 3 stopped with exit 75
    # leaves it), and events of 30 keys in its shards
    _four, three, two = tables(env, tmp_path, 4, 3, 2)
    await _publish_keys(env, [f"key-{n}" for n in range(30)], 1)

    # When a migration to 2 shards is told the install has 3
    code, output = await migrate(env, three, two)

    # Then it is refused with one line naming the shard beyond, and nothing is done: s4 is not
    # left bound to the hash exchange with no replica consuming it
    assert code == 1, output
    assert f"{shard(env, 4)} exists" in output
    assert f"move the messages of {shard(env, 3)}" not in output
    assert await queue_exists(env.amqp_url, shard(env, 3))
    assert sum([await queue_depth(env.amqp_url, q) for q in shards(env, range(1, 5))]) == 30


async def test_a_retry_of_a_removed_shard_expiring_in_its_rung_reaches_its_key_s_shard(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a queue taken from 3 shards to 2 by the migration
    three, two = tables(env, tmp_path, 3, 2)
    code, output = await migrate(env, three, two)
    assert code == 0, output

    # When a retry copy of s3 (an old replica's) waits in the 200ms rung and expires: the rung
    # dead-letters it (at least once) through the redeliver exchange, which has no s3 any more
    async with env.producer() as producer:
        body = envelope_body("test.behave", behave("k"), event_id=uuid.uuid4())
        await producer.send_raw(
            body,
            "test.behave",
            headers={SHARD: "s3", SHARD_KEY: "k", RETRY_RUNG: "200ms"},
            exchange=f"{env.name}.work.retry",
        )

    # Then the redirect hashes it to a staying shard: not lost, not stuck in the rung
    async def arrived() -> bool:
        depths = [await queue_depth(env.amqp_url, q) for q in shards(env, (1, 2))]
        return sum(depths) == 1

    await wait_until(arrived, what="the expired retry of s3 in s1 or s2")
    assert await queue_depth(env.amqp_url, f"{env.name}.work.retry.200ms") == 0


async def test_a_sharded_queue_new_to_the_table_takes_a_type_from_an_unsharded_one(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a table whose queue "work" is unsharded, and a new table where a new queue of 2
    # shards takes test.behave from it
    old = tables(env, tmp_path, 1)[0]
    new = tmp_path / "queues-new.toml"
    new.write_text(
        table(1).replace('["test.behave", ', "[")
        + '\n[queues.keyed]\ntypes = ["test.behave"]\nshards = 2\n'
    )
    env.topologies.append(table_topology(read_queue_table(new, env.settings())))

    # When the migration runs
    code, output = await migrate(env, old, new)

    # Then the new queue is declared whole, its hash exchange hashing the shard key: a key's
    # events go to one shard, and 20 keys to both
    assert code == 0, output
    assert "moved test.behave: from queue work to queue keyed" in output
    await _publish_keys(env, [f"key-{n}" for n in range(20)], 2)
    keyed = [f"{env.name}.keyed.work.s{n}" for n in (1, 2)]
    found = {}
    for queue in keyed:
        messages = await drain_queue(env.amqp_url, queue)
        found[queue] = {str(message.headers[SHARD_KEY]) for message in messages}
        assert len(messages) == 2 * len(found[queue]), queue
    assert all(found.values()), found
    assert not found[keyed[0]] & found[keyed[1]]
    assert await queue_depth(env.amqp_url, f"{env.name}.work.work") == 0
