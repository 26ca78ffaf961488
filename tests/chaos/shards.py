"""A sharded queue in a cluster scenario: the key each event is published with, which shard the
broker's hash ring gives each key, which node leads each shard, which node a fault strikes, and
what the report says about them (events per shard, leaders that moved, each shard's pause).

The producer sets ``consumer-shard-key`` as ``consumer publish`` does: the handler's ``key`` of the
payload (the SKU of a restock or reserve), else the event id; a body with no event id (not JSON)
goes without it, as a producer's would, so to the one shard the header's absence hashes to.

The shard of a key is not guessed in Python: the consistent-hash exchange (RabbitMQ 3.10's plugin)
hashes the header's AMQP value with Erlang's ``phash2`` and a jump consistent hash over its
buckets, and maps the bucket to a queue through its own table. The runner asks a node to do
exactly that for every key (:func:`placement_expression`), at the start and at the end (a node
that boots rebuilds the ring: the plugin does not promise the same placement after a restart).
The dead letters the service publishes carry the shard they were consumed from
(``consumer-shard``): :func:`placement_findings` compares them with the prediction.
"""

from __future__ import annotations

import asyncio
import itertools
import json
import subprocess
import tempfile
import tomllib
import uuid
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import asyncpg

from consumer.cli.producer import shard_key
from consumer.registry import HandlerRegistry
from tests.chaos.observe import DeadCopy
from tests.chaos.workload import PlannedEvent, Workload, publication_of
from tests.servers import ThrowawayRabbit, ThrowawayRabbitCluster
from tests.support import TEST_HANDLERS

HASH_PLUGIN = "rabbitmq_consistent_hash_exchange"
NO_KEY = ""
"""A key line for an event published without the header."""


def sharded(queue_table: str) -> bool:
    """A queue table (TOML text) with a queue of more than one shard."""
    if not queue_table:
        return False
    queues = tomllib.loads(queue_table).get("queues", {})
    return any(int(row.get("shards", 1)) > 1 for row in queues.values())


def shard_keys(workload: Workload, handlers: str = TEST_HANDLERS) -> dict[str, str]:
    """Each event's ``consumer-shard-key`` by its plan key (events with no event id left out):
    what ``consumer publish`` would set."""
    registry = HandlerRegistry.from_modules(handlers.split(","))
    keys: dict[str, str] = {}
    for event in workload.events:
        if event.event_id is None:
            continue
        keys[event.key] = _key_of(registry, event) or str(event.event_id)
    return keys


def _key_of(registry: HandlerRegistry, event: PlannedEvent) -> str | None:
    try:
        body = json.loads(event.body)
    except ValueError:
        return None
    if not isinstance(body, dict):
        return None
    return shard_key(registry, event.routing_key, body.get("payload"))


def placement_expression(exchange: str, keys_file: str, out_file: str) -> str:
    """The ``rabbitmqctl eval`` that writes to ``out_file``, for each line of ``keys_file`` (a
    key, or an empty line for no header), the name of the queue the consistent-hash exchange
    ``exchange`` routes it to, as the plugin's ``route/2`` of RabbitMQ 3.10.8 does: the exchange's
    hash ring (its ``bucket_map``, in the ring state table), ``erlang:phash2`` of the header's
    ``{longstr, Key}`` (``undefined`` without it), a jump consistent hash seeded with that over
    the ring's buckets, the bucket's queue."""
    return (
        f'{{ok, Bin}} = file:read_file("{keys_file}"), '
        'Keys = binary:split(Bin, <<"\\n">>, [global]), '
        f'X = rabbit_misc:r(<<"/">>, exchange, <<"{exchange}">>), '
        "[{chx_hash_ring, _, Ring, _}] = "
        "ets:lookup(rabbit_exchange_type_consistent_hash_ring_state, X), "
        "N = maps:size(Ring), "
        "Jump = fun J(B, Next, _) when Next >= N -> B; "
        "J(_, Next, S) -> {R, S2} = rand:uniform_s(S), J(Next, trunc((Next + 1) / R), S2) end, "
        "Bucket = fun(_) when N =:= 1 -> 0; (K) -> H = erlang:phash2(K), "
        "Jump(-1, 0, rand:seed_s(exs1024, {H, H, H})) end, "
        "Value = fun(<<>>) -> undefined; (K) -> {longstr, K} end, "
        "Name = fun(K) -> {resource, _, queue, Q} = maps:get(Bucket(Value(K)), Ring), Q end, "
        f'ok = file:write_file("{out_file}", [[Name(K), <<"\\n">>] || K <- Keys]).'
    )


def placement(nodes: Sequence[ThrowawayRabbit], exchange: str, keys: Sequence[str]) -> list[str]:
    """The queue each of ``keys`` (``NO_KEY``: no header) is routed to by ``exchange``, asked of
    the first live node of ``nodes``."""
    for node in nodes:
        if node.beam_pid() is None:
            continue
        tag = uuid.uuid4().hex[:8]
        with tempfile.NamedTemporaryFile("w", suffix=".keys", delete=False) as source:
            source.write("\n".join(keys))
        try:
            keys_file = node.add_file(f"shard-keys-{tag}", Path(source.name), mode=0o600)
        finally:
            Path(source.name).unlink()
        out_file = node.base / f"shard-placement-{tag}"
        try:
            result = subprocess.run(
                [
                    *node.ctl_command(),
                    "eval",
                    placement_expression(exchange, str(keys_file), str(out_file)),
                ],
                capture_output=True,
                text=True,
                timeout=120,
                check=False,
            )
            if result.returncode == 0 and out_file.exists():
                return out_file.read_text().split("\n")[: len(keys)]
            answer = (result.stdout + result.stderr).strip()[-500:]
        finally:
            keys_file.unlink(missing_ok=True)
            out_file.unlink(missing_ok=True)
    raise RuntimeError(f"no node could place the keys of {exchange}: {answer}")


def label_of(queue: str) -> str:
    """A shard queue's label (``s2`` of ``svc.q.work.s2``)."""
    return queue.rsplit(".", 1)[-1]


@dataclass
class Placement:
    """Which shard each event went to, by the hash ring at the start and at the end."""

    shards: list[str]
    """The shard labels, in order (``s1``...)."""
    at_start: dict[str, str] = field(default_factory=dict)
    """Plan key -> shard label."""
    at_end: dict[str, str] = field(default_factory=dict)

    def counts(self, workload: Workload) -> Counter[str]:
        """Publications per shard (duplicates count twice: each copy is routed), by the start."""
        return Counter(self.at_start[p.event.key] for p in workload.publications)

    def applied_counts(self, workload: Workload) -> Counter[str]:
        return Counter(self.at_start[e.key] for e in workload.events if e.kind.applies)

    def moved(self) -> list[str]:
        return sorted(k for k, shard in self.at_start.items() if self.at_end.get(k) != shard)


async def place(
    cluster: ThrowawayRabbitCluster,
    exchange: str,
    shards: Sequence[str],
    workload: Workload,
    keys: Mapping[str, str],
    placed: Placement | None = None,
) -> Placement:
    """The hash ring's placement of every event of ``workload``: at the start, or (``placed``
    given) at the end, into it."""
    events = list(workload.events)
    answer = await asyncio.to_thread(
        placement, cluster.nodes, exchange, [keys.get(event.key, NO_KEY) for event in events]
    )
    found = {event.key: label_of(queue) for event, queue in zip(events, answer, strict=True)}
    if placed is None:
        return Placement([label_of(shard) for shard in shards], at_start=found)
    placed.at_end = found
    return placed


def placement_findings(
    placed: Placement, workload: Workload, dead: Iterable[DeadCopy]
) -> tuple[list[str], list[str]]:
    """(notes, violations): publications and events that must apply per shard; a shard that got
    none is a violation (the scenario would not exercise every shard). The dead copies that name
    the shard they were consumed from, against the prediction (notes: a ring rebuilt by a boot
    may place a key elsewhere)."""
    counts = placed.counts(workload)
    applied = placed.applied_counts(workload)
    notes = [
        "publications per shard (the hash ring at the start): "
        + ", ".join(f"{s} {counts[s]:,} ({applied[s]:,} to apply)" for s in placed.shards)
    ]
    violations = [
        f"shard {s} got no publication: the keys do not spread over every shard"
        for s in placed.shards
        if not counts[s]
    ]
    if moved := placed.moved():
        notes.append(
            f"{len(moved)} keys placed on another shard by the ring at the end than at the "
            f"start (first: {moved[:3]})"
        )
    else:
        notes.append("the hash ring placed every key on the same shard at the end as at the start")
    agree, disagree = 0, []
    for copy in dead:
        if copy.shard is None or copy.message_id is None:
            continue
        publication = workload.by_message_id.get(publication_of(copy.message_id))
        if publication is None:
            continue
        key = publication.event.key
        expected = {placed.at_start[key], placed.at_end.get(key, placed.at_start[key])}
        if copy.shard in expected:
            agree += 1
        else:
            disagree.append(f"{copy.message_id} from {copy.shard}, ring says {sorted(expected)}")
    notes.append(
        f"dead copies naming their shard (consumer-shard): {agree + len(disagree):,}, "
        f"{agree:,} from the shard the ring gives their key"
        + (f"; not: {disagree[:5]}" if disagree else "")
    )
    return notes, violations


# -- leaders ---------------------------------------------------------------------------------


def pick_shard_leader(led: Mapping[str, int], connected: int) -> int:
    """The node a shard-leader fault strikes: of the nodes other than ``connected`` (consumer-0's,
    so its connection survives and only the shards' leadership is struck), the one leading the
    most shards, on a tie the one leading the lowest shard; if ``connected`` leads every shard,
    that one."""
    by_node: dict[int, list[str]] = {}
    for shard in sorted(led, key=_shard_order):
        by_node.setdefault(led[shard], []).append(shard)
    others = {node: shards for node, shards in by_node.items() if node != connected}
    if not others:
        return connected
    order = {shard: n for n, shard in enumerate(sorted(led, key=_shard_order))}
    return min(others, key=lambda node: (-len(others[node]), order[others[node][0]]))


def _shard_order(queue: str) -> tuple[int, str]:
    label = label_of(queue)
    return (int(label[1:]) if label[1:].isdigit() else 0, queue)


@dataclass
class Strike:
    """A fault on a shard's leader: when, which node, and each shard's leader before."""

    node: int
    connected: int
    at: datetime
    before: dict[str, int]
    elected: dict[str, float] = field(default_factory=dict)
    """Seconds from the strike until each shard the node led was seen led by another node."""


def describe_strike(strike: Strike, after: Mapping[str, int], names: Sequence[str]) -> str:
    """Which node was struck, which shards it led, and which shards' leaders moved by the end."""

    def where(led: Mapping[str, int]) -> str:
        return ", ".join(
            f"{label_of(q)} on {names[led[q]]}" for q in sorted(led, key=_shard_order) if q in led
        )

    struck = [
        label_of(q)
        for q in sorted(strike.before, key=_shard_order)
        if strike.before[q] == strike.node
    ]
    moved = [
        f"{label_of(q)} {names[strike.before[q]]} -> {names[after[q]]}"
        for q in sorted(strike.before, key=_shard_order)
        if q in after and after[q] != strike.before[q]
    ]
    elected = [
        f"{label_of(q)} {seconds:.1f}s"
        for q, seconds in sorted(strike.elected.items(), key=lambda item: _shard_order(item[0]))
    ]
    return (
        f"struck {names[strike.node]}, leading {', '.join(struck) or 'no shard'} "
        f"(consumer-0 on {names[strike.connected]}); shard leaders before: "
        f"{where(strike.before)}; at the end: {where(after)}; moved: {', '.join(moved) or 'none'}"
        + (f"; another leader seen after the strike: {', '.join(elected)}" if elected else "")
    )


async def pauses(
    dsn: str,
    consumer: str,
    placed: Placement,
    workload: Workload,
    strike: Strike,
    sent_at: Mapping[str, float],
) -> str:
    """Each shard from the strike on: its longest pause between fresh commits (receipts by
    ``received_at``), and when the first event first published after the strike was committed
    (a delivery the consumer cannot have held already: for the struck shard, its new leader's).
    The stream is not held at the fault, but the producer waits for every confirm of its window,
    and a shard without a leader confirms nothing, so every shard's new events wait for it."""
    shard_of = {e.event_id: placed.at_start[e.key] for e in workload.events if e.event_id}
    after = {
        e.event_id
        for e in workload.events
        if e.event_id and sent_at.get(f"{e.key}.0", 0.0) > strike.at.timestamp()
    }
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        rows: list[Any] = await conn.fetch(
            "SELECT event_id, received_at FROM receipts WHERE consumer = $1 AND received_at >= $2 "
            "ORDER BY received_at",
            consumer,
            strike.at,
        )
    finally:
        await conn.close()
    parts = []
    for shard in placed.shards:
        mine = [r for r in rows if shard_of.get(r["event_id"]) == shard]
        times = [strike.at] + [r["received_at"] for r in mine]
        if len(times) == 1:
            parts.append(f"{shard}: no commit after the strike")
            continue
        gap, ended = max(
            ((later - earlier).total_seconds(), later)
            for earlier, later in itertools.pairwise(times)
        )
        new = next((r["received_at"] for r in mine if r["event_id"] in after), None)
        first_new = (
            f"first event published after it committed {(new - strike.at).total_seconds():.1f}s "
            "after it"
            if new is not None
            else "no event published after it"
        )
        parts.append(
            f"{shard}: longest pause {gap:.1f}s (ended {(ended - strike.at).total_seconds():.1f}s "
            f"after the strike), {first_new}"
        )
    return "each shard's commits from the strike on: " + "; ".join(parts)


async def watch_elections(
    cluster: ThrowawayRabbitCluster, strike: Strike, *, timeout: float = 120.0
) -> None:
    """Ask the cluster, again and again, who leads each shard the struck node led, until each is
    led by another node (or ``timeout``): the seconds from the strike into ``strike.elected``.
    Each question is a ``rabbitmqctl`` of a second or more here, so the figure is an upper
    bound."""
    struck = [queue for queue, node in strike.before.items() if node == strike.node]
    deadline = asyncio.get_running_loop().time() + timeout
    while struck and asyncio.get_running_loop().time() < deadline:
        try:
            led = await asyncio.to_thread(cluster.leaders_of, struck)
        except (RuntimeError, subprocess.SubprocessError):
            led = {}
        seen = datetime.now(strike.at.tzinfo)
        for queue in [q for q in struck if q in led and led[q] != strike.node]:
            strike.elected[queue] = (seen - strike.at).total_seconds()
            struck.remove(queue)
        await asyncio.sleep(0.5)
