"""``consumer topology migrate``: a new ladder and delivery limit under load, nothing lost, nothing
applied twice, nothing dead-lettered by the move; resumed or rolled back after an interruption;
a dry run that changes nothing."""

from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime

from consumer.cli.producer import envelope_body
from consumer.cli.topology.migrate import EXIT_PENDING, moved_headers
from consumer.registry import HandlerRegistry
from consumer.service.components import names_for, topology_spec
from tests.servers import free_port
from tests.support import (
    Event,
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    assert_exactly_once,
    behave,
    connect_any,
    fetchval,
    movements,
    movements_at_least,
    queue_depth,
    queue_exists,
    rabbitmqctl,
    restocks,
    run_cli,
    wait_until,
)
from topology.migrate import run_migration
from topology.migration_plan import plan_migration
from topology.names import RETRY_RUNG
from topology.steps import MigrationPlan, Move

NEW = {"retry_delays": "200ms,1s", "delivery_limit": "30", "work_queue_version": "2"}
FROM = (
    "--from-retry-delays=200ms,400ms,800ms",
    "--from-delivery-limit=20",
    "--from-work-queue-version=1",
)


def _migrate(env: TestEnv, *args: str) -> list[str]:
    return ["topology", "migrate", *FROM, *args]


def _old_queues(env: TestEnv) -> list[str]:
    return [env.names.work, f"{env.name}.retry.400ms", f"{env.name}.retry.800ms"]


def _new_queues(env: TestEnv) -> list[str]:
    return [f"{env.name}.work.v2", f"{env.name}.retry.200ms", f"{env.name}.retry.1s"]


async def _exist(env: TestEnv, queues: list[str]) -> list[bool]:
    return [await queue_exists(env.amqp_url, queue) for queue in queues]


def _plan(env: TestEnv) -> MigrationPlan:
    old, new = env.settings(), env.settings(**NEW)
    registry = HandlerRegistry.from_modules(old.handlers)
    return plan_migration(topology_spec(old, registry), topology_spec(new, registry))


async def _prepare(env: TestEnv) -> None:
    await env.apply_topology()
    # The new plan's queues go with the test too.
    env.topologies.append(env.topology(**NEW))


async def test_a_new_ladder_and_delivery_limit_under_load_lose_and_repeat_nothing(
    env: TestEnv,
) -> None:
    # Given a service on the old settings, under load: restocks, and events that fail twice
    # (so the ladder, leaving rungs included, holds some of them while the migration runs)
    await _prepare(env)
    # (a small window, so that a backlog builds: the move and the old consumer share it)
    old = ServiceProcess(env, label="old", prefetch="10", db_pool_size="1")
    await old.start().wait_ready()
    events: list[Event] = []
    flaky = [("test.behave", behave(f"k{i}", fail_transient=2), uuid.uuid4()) for i in range(200)]
    stop = asyncio.Event()

    async def load() -> None:
        # Paced, and on until the replicas have rolled over: events are published while the
        # bindings move, not only before; the flaky ones among them fill the ladder meanwhile.
        async with env.producer() as producer:
            for number in range(10**6):
                if stop.is_set() and len(events) >= 3000:
                    break
                chunk = restocks(100)
                await producer.send_many([*chunk, *flaky[number * 5 : number * 5 + 5]])
                events.extend(chunk)
                await asyncio.sleep(0.1)
            await producer.send_many(flaky[number * 5 :])  # those the last turn did not send

    publishing = asyncio.create_task(load())
    await wait_until(lambda: movements_at_least(env.database_url, 300), what="the load to start")

    # When the migration runs while the old replica consumes
    first = await asyncio.to_thread(run_cli, "consumer", *_migrate(env), env=env.env(**NEW))

    # Then it goes as far as it can: the new queues are in place, the old work queue waits for
    # its consumer
    assert first.returncode == EXIT_PENDING, first.stdout + first.stderr
    assert f"{env.name}.work still has 1 consumers" in first.stdout
    assert await _exist(env, _new_queues(env)) == [True, True, True]
    assert not await queue_exists(env.amqp_url, f"{env.name}.retry.800ms")

    # When the replicas roll over to the new settings and the migration runs again
    new = ServiceProcess(env, label="new", http_port=str(free_port()), **NEW)
    await new.start().wait_ready()
    assert await old.stop() == 0
    stop.set()
    await publishing
    second = await asyncio.to_thread(
        run_cli, "consumer", *_migrate(env, "--wait=60s"), env=env.env(**NEW), timeout=120
    )
    assert second.returncode == 0, second.stdout + second.stderr
    assert f"migrated: {env.name}.work.v2 is the work queue" in second.stdout

    # Then every event is applied exactly once, the old queues are gone, nothing is dead
    await wait_until(
        lambda: movements_at_least(env.database_url, len(events)), timeout=120, what="restocks"
    )

    async def flaky_applied() -> bool:
        count = await fetchval(env.database_url, "SELECT count(*) FROM test_effects")
        return int(count) >= len(flaky)

    await wait_until(flaky_applied, timeout=120, what="the retried events")
    await new.wait_idle()
    await _assert_restocked_once(env, events, also=len(flaky))
    await assert_applied_once(env.database_url, [event_id for _, _, event_id in flaky])
    assert await _exist(env, _old_queues(env)) == [False, False, False]
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
    check = run_cli("consumer", "topology", "check", env=env.env(**NEW))
    assert check.returncode == 0, check.stdout + check.stderr


async def _assert_restocked_once(env: TestEnv, events: list[Event], *, also: int) -> None:
    """Each restock applied once (a movement, a unit), and a receipt for it and ``also`` more."""
    restocked = [event_id for _, _, event_id in events]
    await assert_applied_once(env.database_url, restocked, "stock_movements")
    receipts = await fetchval(env.database_url, "SELECT count(*) FROM receipts")
    assert receipts == len(events) + also
    stock = await fetchval(env.database_url, "SELECT available FROM stock WHERE sku = 'SKU'")
    assert stock == len(events)


async def _forged_events(env: TestEnv, count: int) -> list[uuid.UUID]:
    """``test.behave`` events failing once, whose producer set the service's attempt header
    (as if every retry were used up): the service must not believe it, moved or not."""
    ids = [uuid.uuid4() for _ in range(count)]
    async with env.producer() as producer:
        for number, event_id in enumerate(ids):
            body = envelope_body(
                "test.behave",
                behave(f"f{number}", fail_transient=1),
                event_id=event_id,
                occurred_at=datetime.now(UTC),
            )
            await producer.send_raw(body, "test.behave", headers={"consumer-attempt": 99})
    return ids


async def _run_first_steps(env: TestEnv, plan: MigrationPlan, steps: int) -> None:
    connection = await connect_any(env.amqp_url)
    try:
        report = await run_migration(
            connection,
            plan,
            rewrite_work_headers=moved_headers(names_for(env.settings(**NEW))),
            steps=steps,
        )
    finally:
        await connection.close()
    assert len(report.results) == steps


async def test_an_interrupted_migration_resumes_to_the_same_end(env: TestEnv) -> None:
    # Given events waiting in the old work queue (no consumer) and a migration stopped just
    # after it moved them, before it deleted anything
    await _prepare(env)
    events = restocks(500)
    async with env.producer() as producer:
        await producer.send_many(events)
    forged = await _forged_events(env, 20)
    plan = _plan(env)
    move = next(i for i, s in enumerate(plan.steps, 1) if isinstance(s, Move) and s.from_work)
    await _run_first_steps(env, plan, move)
    assert await queue_depth(env.amqp_url, f"{env.name}.work.v2") == 520
    assert await _exist(env, _old_queues(env)) == [True, True, True]

    # When it runs again
    again = run_cli("consumer", *_migrate(env), env=env.env(**NEW))

    # Then it finishes where an uninterrupted one would have: old queues gone, all moved once
    assert again.returncode == 0, again.stdout + again.stderr
    assert await _exist(env, _old_queues(env)) == [False, False, False]
    assert await queue_depth(env.amqp_url, f"{env.name}.work.v2") == 520
    service = await ServiceProcess(env, **NEW).start().wait_ready()
    await wait_until(lambda: movements_at_least(env.database_url, 500), what="restocks")
    await wait_until(
        lambda: _effects_at_least(env, len(forged)), timeout=60, what="the forged events"
    )
    await service.wait_idle()
    await _assert_restocked_once(env, events, also=len(forged))
    # A producer's attempt header was not believed, before or after the move: retried, applied
    await assert_applied_once(env.database_url, forged)
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def _effects_at_least(env: TestEnv, count: int) -> bool:
    return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) >= count


async def test_an_interrupted_migration_rolls_back(env: TestEnv) -> None:
    # Given a migration stopped after it moved the waiting events into the new work queue
    await _prepare(env)
    events = restocks(300)
    async with env.producer() as producer:
        await producer.send_many(events)
    plan = _plan(env)
    move = next(i for i, s in enumerate(plan.steps, 1) if isinstance(s, Move) and s.from_work)
    await _run_first_steps(env, plan, move)

    # When it is rolled back
    back = run_cli("consumer", *_migrate(env, "--rollback"), env=env.env(**NEW))

    # Then the old plan is whole again, with every event in its work queue, and the new one gone
    assert back.returncode == 0, back.stdout + back.stderr
    assert await _exist(env, _old_queues(env)) == [True, True, True]
    assert await _exist(env, _new_queues(env)) == [False, True, False]  # 200ms: in both plans
    assert await queue_depth(env.amqp_url, env.names.work) == 300
    check = run_cli("consumer", "topology", "check", env=env.env())
    assert check.returncode == 0, check.stdout + check.stderr
    service = await ServiceProcess(env).start().wait_ready()
    await wait_until(lambda: movements_at_least(env.database_url, 300), what="restocks")
    await service.wait_idle()
    await assert_exactly_once(env.database_url, events)
    assert await movements(env.database_url) == 300


async def _queues_of(env: TestEnv) -> list[tuple[str, int]]:
    """The test's queues and their depths (the depth declared: rabbitmqctl's lags behind)."""
    listed = json.loads(await rabbitmqctl("list_queues", "name", "--formatter", "json"))
    names = sorted(q["name"] for q in listed if q["name"].startswith(f"{env.name}."))
    return [(name, await queue_depth(env.amqp_url, name)) for name in names]


async def test_a_dry_run_prints_the_steps_and_changes_nothing(env: TestEnv) -> None:
    await _prepare(env)
    async with env.producer() as producer:
        await producer.send_many(restocks(10))
    before = await _queues_of(env)

    result = run_cli("consumer", *_migrate(env, "--dry-run"), env=env.env(**NEW))

    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    assert lines[0].startswith(f" 1. declare queue {env.name}.work.v2 (quorum;")
    assert f"move the messages of {env.name}.work to exchange {env.name}.redeliver" in result.stdout
    assert lines[-1].endswith(f"delete queue {env.name}.work once empty and without consumers")
    assert await _queues_of(env) == before


async def test_a_new_delivery_limit_without_a_new_work_queue_is_refused(env: TestEnv) -> None:
    result = run_cli(
        "consumer",
        "topology",
        "migrate",
        "--from-delivery-limit=20",
        env=env.env(delivery_limit="30"),
    )
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert "set CONSUMER_WORK_QUEUE_VERSION=2" in result.stderr


async def test_with_no_ladder_left_waiting_and_late_retries_go_straight_back_to_work(
    env: TestEnv,
) -> None:
    # Given a retry copy waiting in the 800ms rung, as the service writes them
    await _prepare(env)
    waiting = uuid.uuid4()
    body = envelope_body(
        "test.behave", behave("w"), event_id=waiting, occurred_at=datetime.now(UTC)
    )
    retry_headers = {"consumer-attempt": 2, RETRY_RUNG: "800ms"}
    async with env.producer() as producer:
        await producer.send_raw(
            body, "test.behave", headers=retry_headers, exchange=env.names.retry
        )
    no_ladder = {"retry_delays": "none"}

    # When the ladder goes
    result = run_cli(
        "consumer", "topology", "migrate", *FROM[:1], env=env.env(**no_ladder), timeout=120
    )

    # Then the rungs are gone, the waiting copy is in the work queue, and a retry an old replica
    # still publishes for a rung is routed there too
    assert result.returncode == 0, result.stdout + result.stderr
    rungs = [f"{env.name}.retry.{label}" for label in ("200ms", "400ms", "800ms")]
    assert await _exist(env, rungs) == [False, False, False]
    assert await queue_depth(env.amqp_url, env.names.work) == 1
    async with env.producer() as producer:
        await producer.send_raw(
            body, "test.behave", headers=retry_headers, exchange=env.names.retry
        )
    await wait_until(
        lambda: _depth_is(env, env.names.work, 2), timeout=10, what="the late retry in work"
    )
    service = await ServiceProcess(env, **no_ladder).start().wait_ready()
    await wait_until(lambda: _effects_at_least(env, 1), what="the retried event")
    await service.wait_idle()
    await assert_applied_once(env.database_url, [waiting])
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def _depth_is(env: TestEnv, queue: str, depth: int) -> bool:
    return await queue_depth(env.amqp_url, queue) == depth


async def test_the_bootstrap_users_permissions_are_enough(env: TestEnv) -> None:
    # Given the least-privileged bootstrap user (deploy/rabbitmq/users.sh: the service's names
    # and the ingress exchange, nothing else; not the default exchange), a retry copy waiting in
    # an hour-long rung that leaves, and events in the old work queue
    await env.apply_topology(retry_delays="200ms,1h")
    new = {"retry_delays": "200ms", "delivery_limit": "30", "work_queue_version": "2"}
    env.topologies.append(env.topology(**new))
    user, owned = f"{env.name}-bootstrap", f"^({env.name}\\..*|{env.name}\\.events)$"
    await rabbitmqctl("add_user", user, "secret")
    try:
        await rabbitmqctl("set_permissions", "-p", "/", user, owned, owned, owned)
        async with env.producer() as producer:
            await producer.send_many(restocks(10))
            body = envelope_body(
                "test.behave", behave("r"), event_id=uuid.uuid4(), occurred_at=datetime.now(UTC)
            )
            headers = {"consumer-attempt": 2, RETRY_RUNG: "1h"}
            await producer.send_raw(body, "test.behave", headers=headers, exchange=env.names.retry)
        assert await queue_depth(env.amqp_url, f"{env.name}.retry.1h") == 1
        url = env.amqp_url.replace("guest:guest@", f"{user}:secret@")

        # When it migrates
        result = run_cli(
            "consumer",
            "topology",
            "migrate",
            "--from-retry-delays=200ms,1h",
            "--from-delivery-limit=20",
            "--from-work-queue-version=1",
            env=env.env(amqp_url=url, **new),
        )
    finally:
        await rabbitmqctl("delete_user", user)

    # Then everything moved: the rung's copy through the retry exchange to the 200ms rung, and
    # from there (expired) to the new work queue with the rest
    assert result.returncode == 0, result.stdout + result.stderr
    assert not await queue_exists(env.amqp_url, f"{env.name}.retry.1h")
    assert not await queue_exists(env.amqp_url, env.names.work)
    await wait_until(
        lambda: _depth_is(env, f"{env.name}.work.v2", 11), timeout=10, what="11 in work.v2"
    )


async def test_a_migration_killed_while_moving_resumes_and_applies_each_event_once(
    env: TestEnv,
) -> None:
    # Given a backlog in the old work queue and a migration killed (SIGKILL) while moving it:
    # some copies confirmed whose originals were never acked
    await _prepare(env)
    events = restocks(5000)
    async with env.producer() as producer:
        await producer.send_many(events)
    command = [sys.executable, "-m", "consumer", *_migrate(env)]
    migration = subprocess.Popen(command, env=env.env(**NEW), stdout=subprocess.DEVNULL)
    try:
        await wait_until(
            lambda: _depth_at_least(env, f"{env.name}.work.v2", 500),
            timeout=60,
            interval=0.05,
            what="the move to start",
        )
    finally:
        migration.kill()
    assert migration.wait() == -signal.SIGKILL
    assert await queue_exists(env.amqp_url, env.names.work)

    # When it runs again
    again = run_cli("consumer", *_migrate(env), env=env.env(**NEW), timeout=120)

    # Then it ends as an uninterrupted one: old queues gone, every event in the new work queue
    # (some twice: moved, then given back and moved again), each applied once
    assert again.returncode == 0, again.stdout + again.stderr
    assert await _exist(env, _old_queues(env)) == [False, False, False]
    assert await queue_depth(env.amqp_url, f"{env.name}.work.v2") >= len(events)
    service = await ServiceProcess(env, **NEW).start().wait_ready()
    await wait_until(
        lambda: movements_at_least(env.database_url, len(events)), timeout=120, what="restocks"
    )
    await service.wait_idle(timeout=60)
    await assert_exactly_once(env.database_url, events)
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def _depth_at_least(env: TestEnv, queue: str, depth: int) -> bool:
    return (
        await queue_exists(env.amqp_url, queue) and await queue_depth(env.amqp_url, queue) >= depth
    )
