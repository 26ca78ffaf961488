"""A retry or dead-letter copy the broker does not confirm (returned, nacked, no confirm in time):
the original goes back to the queue after a pause, never lost, never applied twice."""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import AsyncIterator
from datetime import timedelta
from itertools import pairwise
from typing import Protocol

import aio_pika
import aiormq
import pytest
from pamqp.commands import Basic

from consumer.amqp.publisher import Publisher
from consumer.errors import Unroutable
from tests.support import (
    ServiceProcess,
    TestEnv,
    assert_applied_once,
    behave,
    fetch,
    fetchval,
    queue_depth,
    rabbitmqctl,
    run_cli,
    wait_until,
)
from topology.model import Topology

FILLER = b"filler: not an event"


class DeadLetterFault(Protocol):
    """Something that makes the broker refuse the service's dead-letter publishes."""

    async def start(self) -> None: ...

    async def end(self) -> None: ...


class DeadQueueUnbound:
    """``<name>.dead`` unbound from ``<name>.dlx``: a dead-letter copy cannot be routed, and the
    broker returns it (mandatory)."""

    def __init__(self, env: TestEnv, topology: Topology) -> None:
        self.env = env
        self.binding = next(b for b in topology.bindings if b.queue == env.names.dead)

    async def _queue(
        self, connection: aio_pika.abc.AbstractConnection
    ) -> aio_pika.abc.AbstractQueue:
        channel = await connection.channel()
        return await channel.get_queue(self.env.names.dead, ensure=False)

    async def start(self) -> None:
        connection = await aio_pika.connect(self.env.amqp_url)
        try:
            queue = await self._queue(connection)
            await queue.unbind(self.binding.exchange, self.binding.routing_key)
        finally:
            await connection.close()

    async def end(self) -> None:
        connection = await aio_pika.connect(self.env.amqp_url)
        try:
            queue = await self._queue(connection)
            await queue.bind(self.binding.exchange, self.binding.routing_key)
        finally:
            await connection.close()


class DeadQueueFull:
    """A policy of the test's own makes ``<name>.dead`` full with ``reject-publish``: the broker
    nacks the dead-letter copy's confirm.

    A quorum queue takes a message past its ``max-length`` before it starts refusing, and an
    enqueuer it refused stays refused until the queue is back under its limit while the limit
    still holds (clearing the policy alone leaves the service's channel refused). So: a limit of
    1, filled with fillers until the broker refuses one (which also shows the policy is in force);
    at the end the fillers are taken out first, then the policy cleared.
    """

    def __init__(self, env: TestEnv) -> None:
        self.env = env
        self.policy = f"{env.name}-dead-full"
        self.fillers = 0

    async def start(self) -> None:
        pattern = f"^{re.escape(self.env.names.dead)}$"
        definition = json.dumps({"max-length": 1, "overflow": "reject-publish"})
        await rabbitmqctl(
            *("set_policy", "--apply-to", "queues", "--priority", "1000"),
            *(self.policy, pattern, definition),
        )
        connection = await aio_pika.connect(self.env.amqp_url)
        try:
            channel = await (
                await connection.channel(publisher_confirms=True)
            ).get_underlay_channel()
            for _ in range(100):
                try:
                    await channel.basic_publish(
                        FILLER,
                        routing_key=self.env.names.dead,
                        properties=Basic.Properties(delivery_mode=2),
                        timeout=10,
                    )
                except aiormq.exceptions.DeliveryError:
                    return  # refused: full, and the policy is in force
                self.fillers += 1
            raise AssertionError("the dead-letter queue never refused a publish")
        finally:
            await connection.close()

    async def end(self) -> None:
        connection = await aio_pika.connect(self.env.amqp_url)
        try:
            channel = await connection.channel()
            queue = await channel.get_queue(self.env.names.dead, ensure=False)
            for _ in range(self.fillers):
                message = await queue.get(no_ack=False, fail=True, timeout=10)
                assert message.body == FILLER, "a dead letter got in while the queue was full"
                await message.ack()
        finally:
            await connection.close()
        await rabbitmqctl("clear_policy", self.policy)


@pytest.fixture
async def dead_queue_policy_cleared(env: TestEnv) -> AsyncIterator[None]:
    """Whatever the test did, no policy of its own outlives it."""
    yield None
    policies = json.loads(await rabbitmqctl("list_policies", "--formatter", "json"))
    for policy in policies:
        if policy["name"].startswith(f"{env.name}-"):
            await rabbitmqctl("clear_policy", policy["name"])


@pytest.mark.parametrize("fault", ["unroutable", "nacked"])
async def test_an_unconfirmed_dead_letter_publish_returns_the_original_never_loses_it(
    env: TestEnv, dead_queue_policy_cleared: None, fault: str
) -> None:
    # Given a dead-letter exchange whose copies the broker refuses: returned as unroutable, or
    # nacked by a full dead-letter queue
    topology = await env.apply_topology(delivery_limit="50")
    service = await ServiceProcess(env, delivery_limit="50").start().wait_ready()
    refusal: DeadLetterFault = (
        DeadQueueUnbound(env, topology) if fault == "unroutable" else DeadQueueFull(env)
    )
    await refusal.start()

    # When an event fails for good, its dead-letter copy is refused
    async with env.producer() as producer:
        event_id = await producer.send("test.behave", behave("doomed", permanent=True))

    async def refused_twice() -> bool:
        return await service.metric("consumer_publish_failures_total") >= 2

    await wait_until(refused_twice, what="two refused dead-letter publishes")

    # Then the original went back to the queue each time, after a pause, with no effect
    assert (
        await service.metric("consumer_messages_total", type="test.behave", outcome="returned") >= 2
    )
    assert await service.metric("consumer_dead_letters_total", reason="permanent_failure") == 0
    returned = [
        line
        for line in service.log_lines()
        if line.get("outcome") == "returned" and line.get("event_id") == str(event_id)
    ]
    assert len(returned) >= 2
    assert all(line.get("publish_error") for line in returned)
    called = await fetch(
        env.database_url,
        "SELECT called_at FROM handler_calls WHERE event_id = $1 ORDER BY id",
        event_id,
    )
    gaps = [(b["called_at"] - a["called_at"]).total_seconds() for a, b in pairwise(called)]
    assert len(gaps) >= 2
    assert min(gaps) >= 0.9, gaps  # held a second before each return: no hot loop
    assert await fetchval(env.database_url, "SELECT count(*) FROM test_effects") == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0

    # And when the broker takes dead letters again, the event ends in the DLQ exactly once
    await refusal.end()
    await wait_until(
        lambda: _dead_lettered(service), timeout=30, what="the dead letter to be confirmed"
    )
    await service.wait_idle()
    listed = run_cli("consumer", "dlq", "list", "--json", env=env.env())
    assert listed.returncode == 0, listed.stderr
    letters = [json.loads(line) for line in listed.stdout.splitlines()]
    assert [(letter["id"], letter["reason"]) for letter in letters] == [
        (str(event_id), "permanent_failure")
    ]
    assert await queue_depth(env.amqp_url, env.names.dead) == 1
    assert await fetchval(env.database_url, "SELECT count(*) FROM test_effects") == 0
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 0


async def _dead_lettered(service: ServiceProcess) -> bool:
    return await service.metric("consumer_dead_letters_total", reason="permanent_failure") == 1


async def test_a_confirm_that_never_comes_in_time_returns_the_original_never_loses_it(
    env: TestEnv,
) -> None:
    # Given a service that waits only 1ms for each publisher confirm
    await env.apply_topology()
    service = await ServiceProcess(env, publish_timeout="1ms").start().wait_ready()

    # When events fail once, and their retry copies are not confirmed in time
    async with env.producer() as producer:
        ids = [
            await producer.send("test.behave", behave(f"unconfirmed-{n}", fail_transient=1))
            for n in range(5)
        ]

    # Then each original goes back to the queue and is applied on its next delivery, once; a
    # copy that reached its rung anyway comes back later as a duplicate, with no second effect
    async def all_applied() -> bool:
        return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) >= 5

    await wait_until(all_applied, timeout=60, what="every event applied")
    # (a confirm can still beat 1ms now and then: each failure is an original returned)
    failures = await service.metric("consumer_publish_failures_total")
    assert failures >= 1
    returned = await service.metric(
        "consumer_messages_total", type="test.behave", outcome="returned"
    )
    assert returned == failures

    async def copies_back() -> bool:
        rungs = [env.names.rung(delay) for delay in env.settings().retry_delays]
        return all([await queue_depth(env.amqp_url, rung) == 0 for rung in rungs])

    await wait_until(copies_back, what="retry copies to come back from their rungs")
    await service.wait_idle()
    await assert_applied_once(env.database_url, ids)
    assert await fetchval(env.database_url, "SELECT count(*) FROM receipts") == 5
    assert await queue_depth(env.amqp_url, env.names.dead) == 0


async def test_a_returned_copy_is_not_confirmed_by_another_of_its_message_id(env: TestEnv) -> None:
    # Given the service's publisher, and a queue bound for one routing key of the test's own
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        queue = await channel.declare_queue(f"{env.name}.routed", auto_delete=True)
        await queue.bind("amq.direct", f"{env.name}.routed")
        publisher = await Publisher.on(channel, confirm_within=timedelta(seconds=10))

        async def outcome(routing_key: str) -> str:
            properties = Basic.Properties(message_id=f"{env.name}-shared", delivery_mode=2)
            try:
                await publisher.publish(
                    b"{}", properties, exchange="amq.direct", routing_key=routing_key
                )
            except Unroutable:
                return "unroutable"
            return "confirmed"

        # When two copies sharing a message id are published together, the first unroutable
        outcomes = await asyncio.gather(
            outcome(f"{env.name}.nowhere"), outcome(f"{env.name}.routed")
        )
    finally:
        await connection.close()

    # Then the broker's return fails the copy it dropped, and only the routed one is confirmed
    assert list(outcomes) == ["unroutable", "confirmed"]
