"""The sharded cluster scenarios' planning: which node a shard-leader fault strikes, the key each
event is published with, and what the report says about shards and leaders; and, on a node of the
test's own, that the placement asked of RabbitMQ is where its hash exchange routes each key."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from datetime import UTC, datetime

import aio_pika
import pytest

from tests.chaos.observe import DeadCopy
from tests.chaos.scenarios import SHARDED_TABLE
from tests.chaos.shards import (
    HASH_PLUGIN,
    NO_KEY,
    Placement,
    Strike,
    describe_strike,
    pick_shard_leader,
    placement,
    placement_findings,
    shard_keys,
    sharded,
)
from tests.chaos.workload import Kind, plan_workload
from tests.servers import ThrowawayRabbit
from topology.names import SHARD_KEY

S1, S2, S3 = (f"svc.sharded.work.s{n}" for n in (1, 2, 3))


def test_the_struck_node_leads_the_most_shards_and_is_not_consumer_0_s() -> None:
    # One shard on each node: the lowest shard's leader among the nodes consumer-0 is not on
    assert pick_shard_leader({S1: 0, S2: 1, S3: 2}, connected=0) == 1
    assert pick_shard_leader({S1: 2, S2: 1, S3: 0}, connected=0) == 2
    # Two shards on one node: that one, unless consumer-0 is connected to it
    assert pick_shard_leader({S1: 0, S2: 2, S3: 2}, connected=1) == 2
    assert pick_shard_leader({S1: 0, S2: 2, S3: 2}, connected=2) == 0
    # Shard numbers are compared as numbers (s10 after s2)
    many = {f"svc.q.work.s{n}": node for n, node in ((2, 1), (10, 2), (3, 0))}
    assert pick_shard_leader(many, connected=0) == 1
    # consumer-0's node leads them all: nothing else to strike
    assert pick_shard_leader({S1: 1, S2: 1, S3: 1}, connected=1) == 1


def test_only_a_table_with_a_queue_of_several_shards_is_sharded() -> None:
    assert sharded(SHARDED_TABLE)
    assert not sharded("")
    assert not sharded('[queues.a]\ntypes = ["test.behave"]\n')
    assert not sharded('[queues.a]\ntypes = ["test.behave"]\nshards = 1\n')


def test_events_carry_their_handler_s_key_else_their_id_and_no_key_without_an_id() -> None:
    # Given the normal mix
    workload = plan_workload(2_000, seed=3)

    # When each event's shard key is taken as `consumer publish` takes it
    keys = shard_keys(workload)

    # Then restocks and reserves carry their SKU (the reference handlers' key), the others their
    # event id, and bodies with no event id (not JSON) none
    for event in workload.events:
        if event.kind in (Kind.RESTOCK, Kind.RESERVE):
            assert keys[event.key] == event.sku
        elif event.event_id is None:
            assert event.key not in keys
        else:
            assert keys[event.key] == str(event.event_id), event.kind
    assert {keys[e.key] for e in workload.of_kind(Kind.RESERVE)} == {
        e.sku for e in workload.of_kind(Kind.RESERVE)
    }


def _placed(workload_keys: list[str], shard_of: list[str]) -> Placement:
    return Placement(["s1", "s2", "s3"], at_start=dict(zip(workload_keys, shard_of, strict=True)))


def test_the_findings_count_each_shard_and_check_dead_copies_against_the_ring() -> None:
    # Given a workload placed round the three shards, the same at the end
    workload = plan_workload(300, seed=5)
    keys = [event.key for event in workload.events]
    placed = _placed(keys, [f"s{1 + n % 3}" for n in range(len(keys))])
    placed.at_end = dict(placed.at_start)
    dead_event = next(e for e in workload.events if not e.kind.applies)
    right = placed.at_start[dead_event.key]
    wrong = next(s for s in placed.shards if s != right)
    copies = [
        DeadCopy(f"{dead_event.key}.0", "permanent_failure", None, shard=right),
        DeadCopy(f"{dead_event.key}.0", "permanent_failure", None, shard=wrong),
        DeadCopy(f"{dead_event.key}.0", "permanent_failure", None),  # no shard header: skipped
    ]

    # When the findings are made
    notes, violations = placement_findings(placed, workload, copies)

    # Then every shard has publications, and one dead copy of two agrees with the ring
    assert violations == []
    counts = placed.counts(workload)
    assert sum(counts.values()) == len(workload.publications)
    assert notes[0].startswith("publications per shard (the hash ring at the start): s1 ")
    assert "the same shard at the end" in notes[1]
    assert notes[2].startswith("dead copies naming their shard (consumer-shard): 2, 1 from")
    assert f"{dead_event.key}.0 from {wrong}" in notes[2]


def test_a_shard_with_no_publication_is_a_violation_and_moved_keys_are_noted() -> None:
    workload = plan_workload(300, seed=5)
    keys = [event.key for event in workload.events]
    placed = _placed(keys, ["s1" if n % 2 else "s3" for n in range(len(keys))])
    placed.at_end = {**placed.at_start, keys[0]: "s2"}

    notes, violations = placement_findings(placed, workload, [])

    assert violations == ["shard s2 got no publication: the keys do not spread over every shard"]
    assert notes[1].startswith(
        f"1 keys placed on another shard by the ring at the end than at the start "
        f"(first: ['{keys[0]}']"
    )


def test_the_strike_says_which_node_which_shards_and_which_leaders_moved() -> None:
    strike = Strike(node=2, connected=1, at=datetime.now(UTC), before={S1: 0, S2: 1, S3: 2})

    text = describe_strike(strike, {S1: 0, S2: 1, S3: 0}, ["rabbit@a", "rabbit@b", "rabbit@c"])

    assert text == (
        "struck rabbit@c, leading s3 (consumer-0 on rabbit@b); shard leaders before: "
        "s1 on rabbit@a, s2 on rabbit@b, s3 on rabbit@c; at the end: s1 on rabbit@a, "
        "s2 on rabbit@b, s3 on rabbit@a; moved: s3 rabbit@c -> rabbit@a"
    )

    # And, once watched, how soon another node led each shard the struck node led
    strike.elected[S3] = 4.25
    assert describe_strike(strike, {S1: 0, S2: 1, S3: 0}, ["a", "b", "c"]).endswith(
        "moved: s3 c -> a; another leader seen after the strike: s3 4.2s"
    )


@pytest.fixture
async def hashing_node() -> AsyncIterator[ThrowawayRabbit]:
    """A node of the test's own with the consistent-hash exchange's plugin (the placement is
    asked of it through ``rabbitmqctl eval``, which the shared broker is not open to)."""
    node = ThrowawayRabbit()
    try:
        node.enable_plugins(HASH_PLUGIN)
        await asyncio.to_thread(node.start)
        yield node
    finally:
        await asyncio.to_thread(node.destroy)


@pytest.mark.slow
async def test_the_placement_asked_of_the_node_is_where_the_exchange_routes_each_key(
    hashing_node: ThrowawayRabbit,
) -> None:
    # Given a consistent-hash exchange on the shard key header, with three quorum queues bound
    connection = await aio_pika.connect(hashing_node.url)
    try:
        channel = await connection.channel()
        exchange = await channel.declare_exchange(
            "chx", "x-consistent-hash", arguments={"hash-header": SHARD_KEY}
        )
        names = [f"chx.work.s{n}" for n in (1, 2, 3)]
        for name in names:
            queue = await channel.declare_queue(
                name, durable=True, arguments={"x-queue-type": "quorum"}
            )
            await queue.bind(exchange, "1")
        keys = [str(uuid.uuid4()) for _ in range(40)] + ["CHAOS-1", "CHAOS-2", NO_KEY]

        # When the node is asked where each key goes
        predicted = await asyncio.to_thread(placement, [hashing_node], "chx", keys)

        # Then each key, published with it (or without a header), lands in that queue
        for key, expected in zip(keys, predicted, strict=True):
            before = [await _depth(channel, name) for name in names]
            await exchange.publish(
                aio_pika.Message(b"{}", headers={SHARD_KEY: key} if key else {}), "any"
            )
            grown = [
                name
                for name, depth in zip(names, before, strict=True)
                if await _depth(channel, name) > depth
            ]
            assert grown == [expected], key
        assert len(set(predicted)) == 3
    finally:
        await connection.close()


async def _depth(channel: aio_pika.abc.AbstractChannel, name: str) -> int:
    declared = await channel.declare_queue(name, passive=True)
    return int(declared.declaration_result.message_count or 0)
