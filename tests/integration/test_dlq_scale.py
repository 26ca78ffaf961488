"""The dead-letter tools on a few hundred letters: --limit, filters, selective purge, a replay
stopped half-way, and ``consumer events show``."""

from __future__ import annotations

import asyncio
import json
import re
import signal
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from typing import Any

import aio_pika

from consumer.cli.producer import envelope_body
from tests.support import (
    REPO,
    ServiceProcess,
    TestEnv,
    behave,
    queue_depth,
    run_cli,
    wait_until,
)

RESTOCKS = 200
BEHAVES = 100


def dlq(env: TestEnv, *args: str) -> tuple[int, str, str]:
    result = run_cli("consumer", "dlq", *args, env=env.env(), timeout=120)
    return result.returncode, result.stdout, result.stderr


def listed_ids(env: TestEnv, *filters: str) -> list[str]:
    code, out, err = dlq(env, "list", "--json", *filters)
    assert code == 0, err
    return [json.loads(line)["id"] for line in out.splitlines()]


async def fill_dead_letters(env: TestEnv, *, expired_every: int = 0) -> list[str]:
    """200 permanently failed restocks then 100 exhausted ``test.behave``, interleaved, published
    straight into the dead-letter exchange with the headers the service writes; their ids in
    queue order. With ``expired_every``, the restocks at :func:`_expired_positions` are
    dead-lettered ``expired`` instead."""
    expired = set(_expired_positions(RESTOCKS + BEHAVES, expired_every))
    await env.apply_topology()
    connection = await aio_pika.connect(env.amqp_url)
    ids: list[str] = []
    try:
        channel = await connection.channel(publisher_confirms=True)
        dlx = await channel.get_exchange(env.names.dlx)
        for index in range(RESTOCKS + BEHAVES):
            event_id = uuid.uuid4()
            restock = index % 3 != 2
            event_type = "inventory.restock" if restock else "test.behave"
            payload: dict[str, Any] = (
                {"sku": "S", "qty": 1} if restock else behave(f"k{index}", fail_transient=9)
            )
            reason = "permanent_failure" if restock else "retries_exhausted"
            if index in expired:
                reason = "expired"
            ids.append(str(event_id))
            body = envelope_body(
                event_type, payload, event_id=event_id, occurred_at=datetime.now(UTC)
            )
            message = aio_pika.Message(
                body,
                content_type="application/json",
                delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                headers={"consumer-dead-reason": reason, "consumer-attempt": 3},
                message_id=str(event_id),
            )
            # One at a time: publishes in flight together may reach the queue in another order
            await dlx.publish(message, routing_key=event_type)
    finally:
        await connection.close()
    assert await queue_depth(env.amqp_url, env.names.dead) == RESTOCKS + BEHAVES
    return ids


async def test_limit_and_filters_select_the_same_letters_for_list_purge_and_replay(
    env: TestEnv,
) -> None:
    # Given 300 dead letters: 200 restocks and 100 exhausted retries, interleaved
    ids = await fill_dead_letters(env)
    exhausted = [event_id for index, event_id in enumerate(ids) if index % 3 == 2]

    # list reads the whole queue and keeps its order; a filter shows only its own
    assert listed_ids(env, "--reason", "retries_exhausted") == exhausted
    assert listed_ids(env) == ids
    # --limit stops at the first matching ones in queue order (a partial scan: RabbitMQ 3.10
    # requeues what it read behind what it did not, so the queue's order may change after it)
    assert listed_ids(env, "--type", "test.behave", "--limit", "7") == exhausted[:7]
    code, out, _ = dlq(env, "list", "--limit", "50")
    assert code == 0
    assert "50 dead letters (of 50 in the queue)" in out
    assert "read 50 of the 300 in the queue (--limit)" in out
    assert await queue_depth(env.amqp_url, env.names.dead) == 300

    # purge with a filter: only those go, the others stay, in their order
    before = listed_ids(env)
    code, out, err = dlq(env, "purge", "--type", "test.behave", "--yes")
    assert code == 0, err
    assert "purged 100 of 300 read" in out
    restocks = [event_id for event_id in before if event_id not in exhausted]
    assert listed_ids(env) == restocks

    # replay with a filter and a limit: the first 120 go to the work queue, the rest stay
    code, out, err = dlq(env, "replay", "--type", "inventory.restock", "--limit", "120")
    assert code == 0, err
    assert "replayed 120 of 120 selected" in out
    # (each said as its confirm comes, and confirms of a window come in any order)
    assert sorted(re.findall(r"^replayed (\S+) -> ", out, flags=re.MULTILINE)) == sorted(
        restocks[:120]
    )
    assert await queue_depth(env.amqp_url, env.names.work) == 120
    assert sorted(listed_ids(env)) == sorted(restocks[120:])

    # purge with a limit removes that many, no more
    code, out, err = dlq(env, "purge", "--reason", "permanent_failure", "--limit", "30", "--yes")
    assert code == 0, err
    assert "purged 30 of" in out
    left = listed_ids(env)
    assert len(left) == 50
    assert set(left) < set(restocks[120:])


async def test_a_replay_removes_only_what_it_replayed_whatever_stays_in_between(
    env: TestEnv,
) -> None:
    # Given 300 dead letters: restocks and exhausted behaves interleaved, and every seventh
    # restock dead-lettered as expired (refused without --force)
    ids = await fill_dead_letters(env, expired_every=7)
    behaves = [event_id for index, event_id in enumerate(ids) if index % 3 == 2]
    expired = [ids[index] for index in _expired_positions(len(ids), 7)]
    assert expired

    # When every restock is replayed: the behaves are not selected and the expired ones kept,
    # so the removals are runs broken by letters that stay
    code, out, err = dlq(env, "replay", "--type", "inventory.restock")

    # Then the replayed ones left the dead-letter queue and reached the work queue, and every
    # letter not replayed is still dead, in its order
    assert code == 1, err
    replayed = RESTOCKS - len(expired)
    assert f"replayed {replayed} of {RESTOCKS} selected (300 read); {len(expired)} kept" in out
    assert await queue_depth(env.amqp_url, env.names.work) == replayed
    assert await queue_depth(env.amqp_url, env.names.dead) == BEHAVES + len(expired)
    stayed = set(behaves) | set(expired)
    assert listed_ids(env) == [event_id for event_id in ids if event_id in stayed]


async def test_a_replay_whose_exchange_goes_half_way_loses_nothing_and_sums_up(
    env: TestEnv,
) -> None:
    # Given 300 dead letters and a paced replay of all of them
    await fill_dead_letters(env)
    replay = _start(env, "replay", "--all", "--rate", "30")

    # When its target exchange is deleted while it runs
    await wait_until(lambda: _work_at_least(env, 40), timeout=60, what="40 letters replayed")
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        await channel.exchange_delete(env.settings().exchange)
    finally:
        await connection.close()
    out, _ = await asyncio.to_thread(replay.communicate, timeout=120)

    # Then it stops with a summary, and every letter is replayed or still dead (or, unconfirmed
    # when the channel closed, both: at least once, which the receipts make harmless)
    assert replay.returncode == 1
    replayed = _summary_count(out)
    assert 40 <= replayed < 300
    assert await queue_depth(env.amqp_url, env.names.dead) == 300 - replayed
    work = await queue_depth(env.amqp_url, env.names.work)
    assert replayed <= work
    assert work + 300 - replayed >= 300


async def test_a_replay_the_broker_returns_as_unroutable_keeps_those_letters(
    env: TestEnv,
) -> None:
    # Given 300 dead letters, and nothing bound to the exchange for ``test.behave`` any more
    ids = await fill_dead_letters(env)
    behaves = [event_id for index, event_id in enumerate(ids) if index % 3 == 2]
    binding = next(
        b
        for b in env.topology().bindings
        if b.queue == env.names.work and b.routing_key == "test.behave"
    )
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        work = await channel.get_queue(env.names.work, ensure=False)
        await work.unbind(binding.exchange, binding.routing_key)
    finally:
        await connection.close()

    # When all of them are replayed
    code, out, err = dlq(env, "replay", "--all")

    # Then the restocks are replayed and removed; every behave came back unroutable and stays
    assert code == 1, err
    assert f"replayed {RESTOCKS} of 300 selected (300 read); 0 kept, {BEHAVES} failed" in out
    assert "unroutable" in out
    assert await queue_depth(env.amqp_url, env.names.work) == RESTOCKS
    assert await queue_depth(env.amqp_url, env.names.dead) == BEHAVES
    assert listed_ids(env) == behaves


async def test_a_replay_the_broker_nacks_keeps_those_letters(env: TestEnv) -> None:
    # Given 300 dead letters, and a full queue of the test's own that refuses (nacks) every
    # ``test.behave`` routed to it
    await fill_dead_letters(env)
    refusing = f"{env.name}.refusing"
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            refusing,
            auto_delete=True,
            arguments={"x-max-length": 0, "x-overflow": "reject-publish"},
        )
        await queue.bind(env.settings().exchange, "test.behave")

        # When all of them are replayed
        code, out, err = dlq(env, "replay", "--all")
    finally:
        await connection.close()

    # Then the restocks are replayed and removed; every behave was nacked and stays dead (its
    # copy in the work queue too: at least once, which the receipts make harmless)
    assert code == 1, err
    assert f"replayed {RESTOCKS} of 300 selected (300 read); 0 kept, {BEHAVES} failed" in out
    assert "the broker refused the message" in out
    assert await queue_depth(env.amqp_url, env.names.dead) == BEHAVES
    assert await queue_depth(env.amqp_url, env.names.work) >= RESTOCKS


async def test_ctrl_c_stops_a_replay_with_a_summary_and_nothing_lost(env: TestEnv) -> None:
    # Given a paced replay of 300 dead letters under way
    await fill_dead_letters(env)
    replay = _start(env, "replay", "--all", "--rate", "30")
    await wait_until(lambda: _work_at_least(env, 20), timeout=60, what="20 letters replayed")

    # When the operator presses Ctrl-C
    replay.send_signal(signal.SIGINT)
    out, _ = await asyncio.to_thread(replay.communicate, timeout=60)

    # Then it exits 130 after a summary; the letters not replayed are back in the queue
    assert replay.returncode == 130
    replayed = _summary_count(out)
    assert 20 <= replayed < 300
    assert await queue_depth(env.amqp_url, env.names.dead) == 300 - replayed
    assert await queue_depth(env.amqp_url, env.names.work) == replayed


async def test_events_show_finds_an_applied_a_dead_and_a_retrying_event(env: TestEnv) -> None:
    # Given a service whose one rung waits a minute, and three events
    await env.apply_topology(retry_delays="60s")
    await ServiceProcess(env, retry_delays="60s").start().wait_ready()
    rung = env.names.rung(timedelta(seconds=60))
    async with env.producer() as producer:
        applied = await producer.send("inventory.restock", {"sku": "S", "qty": 1})
        dead = await producer.send("test.behave", behave("d", permanent=True))
        retrying = await producer.send("test.behave", behave("r", fail_transient=5))
    await wait_until(lambda: _depth_is(env, env.names.dead, 1), what="the dead letter")
    await wait_until(lambda: _depth_is(env, rung, 1), what="the retry copy in its rung")

    def show(event_id: uuid.UUID) -> tuple[int, str]:
        result = run_cli(
            "consumer", "events", "show", str(event_id), env=env.env(retry_delays="60s")
        )
        return result.returncode, result.stdout

    # Then each is found where it is
    code, out = await asyncio.to_thread(show, applied)
    assert code == 0
    assert "applied:        inventory.restock occurred_at=" in out
    assert f"dead-lettered:  not in {env.names.dead} (1 read)" in out

    code, out = await asyncio.to_thread(show, dead)
    assert code == 0
    assert "applied:        no receipt" in out
    assert f"dead-lettered:  in {env.names.dead}, reason permanent_failure" in out

    code, out = await asyncio.to_thread(show, retrying)
    assert code == 0
    assert f"retrying:       in {rung}, retry 1 of the ladder" in out

    code, out = await asyncio.to_thread(show, uuid.uuid4())
    assert code == 1
    assert f"not looked for in {env.names.work}" in out
    # And the scans gave everything back
    assert await queue_depth(env.amqp_url, env.names.dead) == 1
    assert await queue_depth(env.amqp_url, rung) == 1


def _start(env: TestEnv, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "consumer", "dlq", *args],
        env=env.env(),
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        preexec_fn=_sigint_as_at_a_terminal,
    )


def _sigint_as_at_a_terminal() -> None:
    """Ctrl-C's default disposition in the command, whatever the tests inherited: a test run
    started in the background without job control (``cmd &`` in a script) ignores SIGINT, and a
    child inherits that, so the command would never see the test's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _summary_count(out: str) -> int:
    found = re.search(r"^replayed (\d+) of (\d+) selected", out, flags=re.MULTILINE)
    assert found, out[-2000:]
    replayed = int(found.group(1))
    assert len(re.findall(r"^replayed \S+ -> ", out, flags=re.MULTILINE)) == replayed
    return replayed


async def _work_at_least(env: TestEnv, count: int) -> bool:
    return await queue_depth(env.amqp_url, env.names.work) >= count


async def _depth_is(env: TestEnv, queue: str, count: int) -> bool:
    return await queue_depth(env.amqp_url, queue) == count


def _expired_positions(count: int, every: int) -> list[int]:
    """Every ``every``-th restock's position (restocks are those not at ``index % 3 == 2``)."""
    if not every:
        return []
    restocks = [index for index in range(count) if index % 3 != 2]
    return restocks[every - 1 :: every]


async def test_two_letters_sharing_a_message_id_keep_the_one_the_broker_returned(
    env: TestEnv,
) -> None:
    # Given two dead letters of different events that share a message id (the producer's own,
    # copied into every copy): an exhausted ``test.behave``, which nothing is bound for any
    # more, ahead of a restock
    await env.apply_topology()
    shared = f"order-{uuid.uuid4()}"
    unroutable, routable = uuid.uuid4(), uuid.uuid4()
    connection = await aio_pika.connect(env.amqp_url)
    try:
        channel = await connection.channel(publisher_confirms=True)
        dlx = await channel.get_exchange(env.names.dlx)
        for event_id, event_type, payload in (
            (unroutable, "test.behave", behave("k", fail_transient=9)),
            (routable, "inventory.restock", {"sku": "S", "qty": 1}),
        ):
            body = envelope_body(
                event_type, payload, event_id=event_id, occurred_at=datetime.now(UTC)
            )
            await dlx.publish(
                aio_pika.Message(
                    body,
                    content_type="application/json",
                    delivery_mode=aio_pika.DeliveryMode.PERSISTENT,
                    headers={"consumer-dead-reason": "permanent_failure", "consumer-attempt": 3},
                    message_id=shared,
                ),
                routing_key=event_type,
            )
        binding = next(
            b
            for b in env.topology().bindings
            if b.queue == env.names.work and b.routing_key == "test.behave"
        )
        work = await channel.get_queue(env.names.work, ensure=False)
        await work.unbind(binding.exchange, binding.routing_key)
    finally:
        await connection.close()
    assert await queue_depth(env.amqp_url, env.names.dead) == 2

    # When both are replayed (their publishes in flight together)
    code, out, err = dlq(env, "replay", "--all")

    # Then the letter whose copy the broker returned stays, and only the routed one is removed:
    # a return is not taken for the other publish of the same message id
    assert code == 1, err
    assert "replayed 1 of 2 selected (2 read); 0 kept, 1 failed" in out
    assert "unroutable" in out
    assert await queue_depth(env.amqp_url, env.names.work) == 1
    assert listed_ids(env) == [str(unroutable)]
