"""The guarantee beyond one machine: a three-node RabbitMQ cluster losing the node that leads the
work queue, and a PostgreSQL primary failing over to its synchronous standby, under a real
``python -m consumer run`` (the chaos suite, ``tests/chaos``, runs the longer versions)."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest

from tests.conftest import make_template
from tests.servers import ThrowawayPostgresPair, ThrowawayRabbitCluster
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_exactly_once,
    movements_at_least,
    queue_depth,
    restocks,
    wait_until,
)


@pytest.fixture
def cluster() -> Iterator[ThrowawayRabbitCluster]:
    nodes = ThrowawayRabbitCluster()
    try:
        nodes.start()
        yield nodes
    finally:
        nodes.destroy()


@pytest.fixture
def sync_pair() -> Iterator[ThrowawayPostgresPair]:
    pair = ThrowawayPostgresPair(synchronous=True)
    try:
        pair.start()
        yield pair
    finally:
        pair.destroy()


@pytest.mark.slow
async def test_the_work_queue_leader_dies_under_load_and_every_event_is_applied_once(
    cluster: ThrowawayRabbitCluster, env: TestEnv
) -> None:
    # Given a quorum work queue replicated on the three nodes, declared through the first (its
    # leader, then), and a service given the whole list starting at another node
    env = dataclasses.replace(
        env,
        amqp_url=cluster.urls[0],
        topologies=[],
        overrides={**env.overrides, "quorum_initial_group_size": "3"},
    )
    await env.apply_topology()
    leader = cluster.leader_of(env.names.work)
    rotated = cluster.urls[leader + 1 :] + cluster.urls[: leader + 1]
    events = restocks(3000)
    async with env.producer() as producer:
        await producer.send_many(events)
    service = await ServiceProcess(env, amqp_url=",".join(rotated)).start().wait_ready()

    # When the leader is SIGKILLed while the service works through the backlog
    await wait_until(
        lambda: movements_at_least(env.database_url, 500), timeout=60, what="500 applied"
    )
    await asyncio.to_thread(cluster.kill, leader)

    # Then a follower takes over, the rest is applied, and the node comes back into the cluster
    await wait_until(
        lambda: movements_at_least(env.database_url, 3000), timeout=120, what="all 3,000 applied"
    )
    assert cluster.leader_of(env.names.work) != leader
    await asyncio.to_thread(cluster.start_node, leader)
    await asyncio.to_thread(cluster.await_members, 3)
    await service.wait_ready(timeout=30)
    await service.wait_idle(timeout=60)
    await assert_exactly_once(env.database_url, events)
    assert await queue_depth(cluster.url_list, env.names.work) == 0
    assert await queue_depth(cluster.url_list, env.names.dead) == 0


@pytest.mark.slow
async def test_a_primary_killed_mid_stream_fails_over_to_its_synchronous_standby_losing_nothing(
    sync_pair: ThrowawayPostgresPair, env: TestEnv
) -> None:
    # Given a service on both hosts of a synchronous pair, read-write wanted
    await make_template(sync_pair.admin_dsn, "consumer")
    env = dataclasses.replace(env, database_url=sync_pair.dsn("consumer"))
    await env.apply_topology()
    events = restocks(2000)
    async with env.producer() as producer:
        await producer.send_many(events)
    service = await ServiceProcess(env).start().wait_ready()

    # When the primary is SIGKILLed mid-stream and the standby promoted
    await wait_until(
        lambda: movements_at_least(env.database_url, 500), timeout=60, what="500 applied"
    )
    await asyncio.to_thread(sync_pair.kill_primary)
    await asyncio.sleep(1)  # the service meets the dead primary before there is a new one
    await asyncio.to_thread(sync_pair.promote_standby)

    # Then every event is applied exactly once on the new primary, and none is dead-lettered
    await wait_until(
        lambda: movements_at_least(env.database_url, 2000), timeout=120, what="all 2,000 applied"
    )
    await service.wait_ready(timeout=30)
    await service.wait_idle(timeout=60)
    await assert_exactly_once(env.database_url, events)
    assert await queue_depth(env.amqp_url, env.names.dead) == 0
