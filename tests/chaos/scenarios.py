"""The scenarios (one fault each, then all together; handler faults one by one and together; a
broker resource alarm; hostile producers) and the two profiles that size them."""

from __future__ import annotations

import signal
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from consumer.service.watchdog import EXIT_HARD_TIMEOUT
from tests.chaos.clock import SkewClock
from tests.chaos.faults import (
    BrokerAlarm,
    CloseConnections,
    FailoverPostgres,
    Fault,
    FreezeNode,
    FreezePostgres,
    Kill,
    KillNode,
    RelayKill,
    RestartPostgres,
    RestartRabbit,
    RollingRestart,
    Terminate,
)
from tests.chaos.netfaults import CommitCut, Cut, Degrade, NodePartition
from tests.chaos.workload import OUTBOX_HANDLERS, SLOW_S, Kind
from tests.support import TEST_HANDLERS

# What every consumer of every scenario runs with, on top of tests.support.TestEnv's test settings
# (retry ladder 200ms,400ms,800ms; shutdown grace 10s; reconnect backoff capped at 1s).
CONSUMER_SETTINGS = {"handler_timeout": "1s"}
HARD_TIMEOUT = "2s"
"""Where handlers block the event loop: the hard time limit, low so that crash loops are short."""
MEASURING_HARD_TIMEOUT = "60s"
"""Where the consumers are SIGSTOPped while a block is published (``hostile-producers``): past the
runner's longest hold, which the watchdog would otherwise take for a blocked loop."""
STALL_TIMEOUT = "300ms"
"""Where a duplicate meets its first copy in a slow handler: below the handler's sleep."""
RECEIPT_WINDOW = {
    "receipt_retention": "30s",
    "receipt_margin": "10s",
    "receipt_partition": "1s",
    "receipt_prune_interval": "1s",
    "max_future_skew": "2s",
    "max_clock_skew": "5s",
}
"""``receipt-pruning``: events older than 20s are refused, every second a partition goes. The
window is wider than publishing the scenario's events takes (:attr:`Profile.pruning_events`), so
that originals expire only on a machine too slow for it (then every copy is in the DLQ, reason
``expired``: not lost)."""
SECOND_PARTITIONS = """
DO $$
DECLARE
    partition text;
BEGIN
    FOR partition IN
        SELECT name FROM consumer_receipt_partitions WHERE name <> 'receipts_legacy'
    LOOP
        EXECUTE format('DROP TABLE %I', partition);
    END LOOP;
    DELETE FROM consumer_receipt_partitions WHERE name <> 'receipts_legacy';
END
$$
"""
"""Without the migration's daily partitions: the consumers make partitions a second wide from
their start-up on."""
EXIT_CRASH = 17
"""``test.behave``'s ``crash``: ``os._exit(17)``."""

Site = Literal["node", "cluster", "pg-sync", "pg-async", "net", "net-cluster"]
"""Where a scenario runs: the run's RabbitMQ node and PostgreSQL; the run's three-node RabbitMQ
cluster (each consumer given the node list starting at another node; quorum queues on all three);
the run's node and a PostgreSQL primary with a synchronous or asynchronous standby of the
scenario's own, which its fault fails over; or the network-fault lab (:mod:`.netsite`): a
PostgreSQL, a RabbitMQ node, the consumers and the runner each in a network namespace of its own;
or that lab with a three-node RabbitMQ cluster instead of the node, each node on a host of its own
(``net_site(cluster=True)``)."""
CLUSTER_SETTINGS = {"quorum_initial_group_size": "3"}
MIB = 1024 * 1024


SHARDED_CLUSTER = ("cluster-shards-leader-kill", "cluster-shards-node-freeze")
"""The cluster's leader kill and node freeze with the work queue in 3 shards (:func:`sharded`)."""
BEYOND_ONE = (
    "cluster-leader-kill",
    "cluster-node-freeze",
    "cluster-rolling-restart",
    "cluster-connected-node-kill",
    "cluster-scale-out",
    "pg-failover-sync",
    "pg-failover-async",
    *SHARDED_CLUSTER,
)
"""The scenarios on a RabbitMQ cluster or a PostgreSQL failover pair."""


SHORT_HEARTBEAT = 2
"""Seconds: the consumers' AMQP heartbeat where a cut must outlast it (aiormq gives a silent
broker up after a few heartbeats), short so that the scenario stays short."""
BROKER_CUT_S = 10.0
"""A silent cut shorter than the default heartbeat (60s): TCP's retransmissions carry the
connection over it, or the service notices."""
LONG_BROKER_CUT_S = 12.0
"""A silent cut past :data:`SHORT_HEARTBEAT`'s timeout: the service must notice and reconnect."""
DATABASE_CUT_S = 8.0
"""A one-way cut between the service and PostgreSQL: past the stall timeout (5s), which ends the
connection of a statement (a COMMIT) that gets no answer, and past the orphan session's
``idle_in_transaction_session_timeout`` (6s at the scenario's 2s hard limit)."""
DATABASE_LOST = "database unreachable, pausing consumption"
NET = (
    "net-broker-cut",
    "net-broker-cut-heartbeat",
    "net-pg-reply-lost",
    "net-pg-request-lost",
    "net-latency-loss",
    "net-clean",
)
"""The network-fault lab's scenarios."""
DEGRADED_S = 10.0
"""The short profile's stretch of latency and loss (the long one's: 5 minutes)."""
DEGRADED_RATE = 50.0
"""Publications a second through the proxy: a steady stream the degraded links are measured
under, not a backlog."""
NET_CLUSTER = ("net-node-partition", "net-node-partition-leader")
"""The lab cluster's scenarios: named only in the short profile (the cluster takes 30-60s to start
in the lab here, each scenario about a minute more: past what `make test` can spend)."""
PARTITION_RATE = 25.0
"""Publications a second of the short profile's partition scenarios: a stream that spans the cut
(2.5 times its length), for the service to carry on the majority while it holds."""
QUEUE_TABLE_ALONE = ("queue-table-stall", "queue-table-storm")
"""``queue-table``'s troubles one at a time, with no death of the process: what a stalled
handler, or a storm of dead letters, in one queue costs the other two (their rates before,
during and after, reported)."""


OUTBOX = (
    "outbox-relay-kill",
    "outbox-rabbit-restart",
    "outbox-postgres-restart",
    "outbox-replicas",
)
"""The outbox's scenarios (issue 34)."""

OUTBOX_NAMED_ONLY = tuple(slug for slug in OUTBOX if slug != "outbox-relay-kill")
"""Run in the short profile only when named: one outbox scenario runs in `make test`."""
QUEUE_TABLE_PROCESSES = "queue-table-processes"
"""``queue-table``'s table, troubles and faults with its queues split over two processes of the
service (``--queues faulty``, ``--queues batch,stock``): what process isolation buys, measured.
Long profile; named in the short (about as long as ``queue-table``: a minute or more)."""


NET_NAMED_ONLY = ("net-broker-cut", "net-pg-request-lost", "clock-behind", "net-clean")
"""Run in the short profile only when named: one scenario of each kind runs in `make test`."""


@dataclass(frozen=True)
class Profile:
    name: str
    events: int
    """Publications per scenario (duplicates and poison included)."""
    rate: float
    """Publications a second: about what the consumers apply, so faults land on a live stream."""
    kills: int
    terms: int
    closes: int
    rabbit_restarts: int
    postgres_restarts: int
    freezes: int
    all_together_rounds: int
    swallows: int
    """``swallow`` events where a scenario has them (half through the batch handler)."""
    odd: int
    """``odd_poison`` events, and as many valid ``odd`` ones."""
    connection_kills: int
    blocks: int
    crashes: int
    slow_duplicates: int
    alarms: int
    hostile: int
    """``hostile-producers``: so many ``headers_too_deep``, ``too_complex`` and ``forged_headers``
    messages, and twice as many of each ``hostile_headers*`` kind."""
    hostile_events: int | None
    """Publications of ``hostile-producers`` (None: :attr:`events`)."""
    oversized: int
    """``hostile-producers``: bodies over ``CONSUMER_MAX_BODY_BYTES``, of :attr:`oversized_bytes`
    each, sent in the attacked block."""
    oversized_bytes: int
    probe: int
    """``hostile-producers``: innocent events in each of the clean and the attacked blocks whose
    throughput is compared."""
    named_only: frozenset[str]
    """Scenarios run only when named (``--scenario``)."""
    freeze_s: float = 4.0
    alarm_s: float = 5.0
    node_freeze_s: float = 30.0
    """How long a cluster node stays SIGSTOPped."""
    node_partition_s: float = 60.0
    """How long a lab cluster node stays cut off from its peers (past ``NET_TICKTIME``, 10s)."""
    cluster_events: int | None = None
    """Publications of the cluster and failover scenarios (None: :attr:`events`)."""
    net_events: int | None = None
    """Publications of the network-fault lab's scenarios (None: :attr:`events`)."""
    pruning_events: int | None = None
    """Publications of ``receipt-pruning`` (None: :attr:`events`): no more than the consumers
    settle well inside its 20s window, else late copies expire by design (dead-lettered
    ``expired``, not applied), which the scenario does not test."""
    stalls: int = 5
    """``queue-table``: events whose handler awaits :data:`~tests.chaos.workload.STALL_S` in
    the faulty queue."""
    storm: int = 150
    """``queue-table``: ``odd_poison`` events dead-lettered in a burst from the faulty queue."""
    relay_kills: int = 3
    """``outbox-relay-kill``: SIGKILLs of the relay between a confirm and the mark."""
    outbox_events: int | None = None
    """Publications of the outbox scenarios (None: :attr:`events`)."""
    settle_timeout: float = 60.0
    """After publishing, how long the consumers get to finish."""
    budget: float = 220.0
    """The whole run, servers included: scenarios not started by then are skipped (a failure)."""


PROFILES = {
    "short": Profile(
        name="short",
        events=2_000,
        rate=700,
        kills=3,
        terms=2,
        closes=2,
        rabbit_restarts=1,
        postgres_restarts=2,
        freezes=1,
        all_together_rounds=1,
        swallows=40,
        odd=20,
        connection_kills=3,
        blocks=2,
        crashes=2,
        slow_duplicates=10,
        alarms=1,
        hostile=4,
        hostile_events=600,
        oversized=4,
        oversized_bytes=8 * MIB,
        probe=600,
        # The handler faults run together here (`handler-faults`); each alone when named. The
        # cluster and failover scenarios too: tests/integration/test_cluster.py runs a leader kill
        # and a synchronous failover in `make test` already, and a cluster takes 20-30s to start.
        # The network lab's: one of each kind of fault (a broker cut, a COMMIT cut, ...).
        named_only=frozenset(
            {
                "swallow",
                "blocking",
                "crashing",
                "odd-payload",
                "kill-connection",
                *BEYOND_ONE,
                *NET_NAMED_ONLY,
                # One partition of a node in `make test` (the follower's); its leader variant
                # long only: the lab cluster's start is about 1-2.5 minutes here.
                "net-node-partition-leader",
                *QUEUE_TABLE_ALONE,
                # One outbox scenario in `make test` (the relay killed in its window); the
                # broker's and the database's restarts and the replicas long only.
                *OUTBOX_NAMED_ONLY,
                QUEUE_TABLE_PROCESSES,
            }
        ),
        alarm_s=3.0,
        # `outbox-relay-kill` in `make test`: 18-33s with 2,000 events at load averages of 7-10
        # here, 86s at 15 (each relay kill's restart 1-7s, the follow-ups about 40% more
        # effects); half of that for the suite's other work.
        outbox_events=1_000,
        node_freeze_s=10.0,
        node_partition_s=25.0,
        cluster_events=1_500,
        net_events=600,
        settle_timeout=60,
        # About 250s on a quiet machine; 350s was overrun at a load average of 10 (other work on
        # both cores), before hostile-producers had started. The budget is there for a hang; 720s
        # since the network lab (its start and four scenarios: about 2 minutes; the whole profile
        # took 516s under other sessions' load with it). 840s since queue-table (228s at a load
        # average of 15-18 on the shared cores). 1080s since the node partition (the lab
        # cluster's start, 2.5 minutes under a CI run's load, and the scenario, 98s).
        budget=1080,
    ),
    "long": Profile(
        name="long",
        events=50_000,
        rate=500,
        kills=8,
        terms=4,
        closes=6,
        rabbit_restarts=3,
        postgres_restarts=4,
        freezes=3,
        all_together_rounds=3,
        swallows=1_000,
        odd=500,
        connection_kills=20,
        blocks=5,
        crashes=5,
        slow_duplicates=60,
        alarms=4,
        hostile=100,
        hostile_events=None,
        oversized=24,
        oversized_bytes=32 * MIB,
        probe=2_000,
        named_only=frozenset({"handler-faults"}),
        pruning_events=5_000,
        relay_kills=8,
        stalls=20,
        storm=2_000,
        settle_timeout=300,
        budget=3 * 3600,
    ),
}


@dataclass(frozen=True)
class Scenario:
    slug: str
    title: str
    consumers: int = 1
    faults: Sequence[Fault] = ()
    settings: dict[str, str] = field(default_factory=dict)
    mix_in: Mapping[Kind, int] = field(default_factory=dict)
    """Handler-fault events mixed into the normal workload, by kind."""
    self_exits: frozenset[int] = frozenset()
    """Exit codes with which a consumer may exit by itself here: it is started again, as a
    supervisor would, and the exit is reported, not a violation (any other exit is one)."""
    never_pauses: bool = False
    """A consumer log line saying ``pausing`` is a violation."""
    supervised: bool = False
    """Restart a consumer that exits by itself all along, as a supervisor would, even where no
    exit is expected (such an exit is still a violation unless its code is in ``self_exits``)."""
    keeps_broker_links: bool = False
    """No fault touches the broker here: a consumer that loses its RabbitMQ connection (a
    ``lost RabbitMQ`` log line) or sees a delivery come back redelivered is a violation."""
    events: int | None = None
    """Publications, where not the profile's."""
    site: Site = "node"
    losses_reported: bool = False
    """Events acked with no effect are expected here (asynchronous replication): the report
    counts them as lost, and they, and what follows from them (stock, the consumers' counts),
    are not violations."""
    database_setup: str = ""
    """SQL run on the scenario's database (a copy of the migrated template) before any consumer
    starts."""
    measures: bool = False
    """Measure the consumers' peak RSS against the budget they logged, and the throughput of
    innocent events clean and under attack (:attr:`Profile.probe`), before the stream: the mix-in
    kinds in :data:`~tests.chaos.workload.ATTACK` go in the attacked block, not the stream."""
    expired_copies: bool = False
    """Copies of an applied event may be dead-lettered ``expired`` (its receipts' window is short
    here): counted, not a violation. An event with no effect is still lost."""
    amqp_query: str = ""
    """Appended to the consumers' ``CONSUMER_AMQP_URL`` (``?heartbeat=5``): the runner's own
    connections keep the plain URL."""
    lost_event: str = "lost RabbitMQ"
    """The consumers' log line that says they noticed a cut (the time to detect)."""
    faked_clock: bool = False
    """The consumers run under libfaketime, on the true time until a fault moves their clock
    (:class:`~tests.chaos.clock.SkewClock`)."""
    via_proxy: bool = False
    """In the network lab: the consumers reach RabbitMQ and PostgreSQL through the latency proxy
    (:mod:`.proxy`) on its own host; the runner reaches them directly."""
    rate: float | None = None
    """Publications a second, where not the profile's."""
    queue_table: str = ""
    """A queue table (``CONSUMER_QUEUES_FILE``'s TOML) the consumers run: the checks are made
    queue by queue too (:func:`~tests.chaos.verify.by_queue`)."""
    faulty_queue: str = ""
    """The table's queue whose handlers misbehave: the others' throughput is measured before,
    during and after its trouble (the ``mix_in`` events, gathered in :attr:`trouble`)."""
    trouble: tuple[float, float] | None = None
    """Where the ``mix_in`` events go in the stream (shares of its publications), instead of
    anywhere: the stream before that stretch is clean of them."""
    settle_timeout: float | None = None
    """After publishing, how long the consumers get to finish, where not the profile's."""
    processes: tuple[str, ...] = ()
    """With :attr:`queue_table`: consumer ``n`` runs ``consumer run --queues processes[n]`` (a
    process per class of work, as a deployment per queue does); empty: each runs every queue."""
    shares: tuple[float, ...] = ()
    """The share of the effects at which each fault strikes, where not spread evenly."""
    first_node: int = 1
    """On a cluster: consumer ``n``'s node list starts at node ``n + first_node`` (1: consumer-0
    is not on the first node, through which the work queue was declared and which leads it)."""
    loses_commit_replies: bool = False
    """PostgreSQL's answers to the service may be lost while its statements arrive: a COMMIT
    that committed unknown to the service is counted a ``duplicate`` when its event's re-run
    finds the receipt, so the consumers' ``processed`` may fall short of the effects."""
    wraps_relay: bool = False
    """The consumers run under :mod:`tests.chaos.relay_kill` (their relay's mark step wrapped,
    armed by :class:`~tests.chaos.faults.RelayKill`)."""
    relays_all: bool = False
    """Every consumer's relay must have published rows (their last scrapes before they ended):
    several replicas relayed the outbox side by side."""

    @property
    def cuts_broker_links(self) -> bool:
        """A fault, or a consumer exiting by itself, can fall between a publisher confirm and
        the ack of the original (an extra dead copy)."""
        return bool(self.self_exits) or any(fault.cuts_broker_links for fault in self.faults)

    def schedule(self) -> list[tuple[float, Fault]]:
        """Each fault with the share of the effects that must be applied before it strikes:
        spread between 10% and 85%, so every one lands while events flow."""
        if self.shares:
            return list(zip(self.shares, self.faults, strict=True))
        count = len(self.faults)
        if count == 1:
            return [(0.4, self.faults[0])]
        return [(0.10 + 0.75 * n / (count - 1), fault) for n, fault in enumerate(self.faults)]


def scenarios_for(profile: Profile) -> list[Scenario]:
    """Every scenario, sized for ``profile`` (see :func:`chosen` for those it runs)."""
    p = profile
    one_round: list[Fault] = [
        Kill(0),
        CloseConnections(),
        Terminate(1),
        FreezePostgres(p.freeze_s),
        RestartRabbit(),
        RestartPostgres(),
        Kill(2),
    ]
    together = one_round * p.all_together_rounds
    together[-1] = Kill(2, restart=False)
    return [
        Scenario("baseline", "none (baseline)"),
        Scenario("sigkill", f"SIGKILL + restart x{p.kills}", faults=[Kill()] * p.kills),
        Scenario("sigterm", f"SIGTERM + restart x{p.terms}", faults=[Terminate()] * p.terms),
        Scenario(
            "close-connections",
            f"broker closes all connections x{p.closes}",
            faults=[CloseConnections()] * p.closes,
        ),
        Scenario(
            "rabbit-restart",
            f"RabbitMQ restart x{p.rabbit_restarts}",
            faults=[RestartRabbit()] * p.rabbit_restarts,
        ),
        Scenario(
            "postgres-restart",
            f"PostgreSQL restart x{p.postgres_restarts}",
            faults=[RestartPostgres()] * p.postgres_restarts,
        ),
        Scenario(
            "postgres-freeze",
            f"PostgreSQL SIGSTOP {p.freeze_s:g}s (> 1s handler timeout) x{p.freezes}",
            faults=[FreezePostgres(p.freeze_s)] * p.freezes,
        ),
        Scenario(
            "competing",
            "3 competing consumers, one SIGKILLed (left dead)",
            consumers=3,
            faults=[Kill(1, restart=False)],
        ),
        Scenario(
            "all-together",
            f"all of the above, 3 consumers, {len(together)} faults",
            consumers=3,
            faults=together,
        ),
        Scenario(
            "handler-faults",
            f"handler faults together, 2 consumers: {p.swallows} swallow, {p.odd} odd payloads, "
            f"{p.connection_kills} kill their connection, {p.blocks} block, {p.crashes} crash",
            consumers=2,
            settings={"hard_timeout": HARD_TIMEOUT},
            mix_in={
                Kind.SWALLOW: p.swallows,
                Kind.ODD_POISON: p.odd,
                Kind.ODD: p.odd,
                Kind.KILL_CONNECTION: p.connection_kills,
                Kind.BLOCK: p.blocks,
                Kind.CRASH: p.crashes,
            },
            self_exits=frozenset({EXIT_HARD_TIMEOUT, EXIT_CRASH}),
        ),
        Scenario(
            "swallow",
            f"handler swallows a database error x{p.swallows} (half in batches)",
            mix_in={Kind.SWALLOW: p.swallows},
        ),
        Scenario(
            "blocking",
            f"handler blocks the loop past the {HARD_TIMEOUT} hard limit x{p.blocks}, "
            "2 consumers restarted",
            consumers=2,
            settings={"hard_timeout": HARD_TIMEOUT},
            mix_in={Kind.BLOCK: p.blocks},
            self_exits=frozenset({EXIT_HARD_TIMEOUT}),
        ),
        Scenario(
            "crashing",
            f"handler crashes the process x{p.crashes}, 2 consumers restarted",
            consumers=2,
            mix_in={Kind.CRASH: p.crashes},
            self_exits=frozenset({EXIT_CRASH}),
        ),
        Scenario(
            "odd-payload",
            f"payload validator raises AttributeError x{p.odd} (+{p.odd} valid)",
            mix_in={Kind.ODD_POISON: p.odd, Kind.ODD: p.odd},
        ),
        Scenario(
            "kill-connection",
            f"handler kills its database connection x{p.connection_kills}",
            mix_in={Kind.KILL_CONNECTION: p.connection_kills},
        ),
        Scenario(
            "slow-duplicate",
            f"duplicate during a {SLOW_S:g}s handler x{p.slow_duplicates}, "
            f"{STALL_TIMEOUT} stall timeout, never pauses",
            settings={"db_stall_timeout": STALL_TIMEOUT},
            mix_in={Kind.SLOW_DUPLICATE: p.slow_duplicates},
            never_pauses=True,
        ),
        Scenario(
            "hostile-producers",
            f"hostile producers, 2 consumers supervised: {p.hostile} deep headers, {p.hostile} "
            f"too complex, {p.hostile} forged, {4 * p.hostile} headers or ids to make safe; "
            f"{p.hostile} header floods amid {p.probe} innocents and {p.oversized} bodies of "
            f"{p.oversized_bytes // MIB} MiB amid {p.probe} more, after {p.probe} clean; "
            f"{p.hostile} each of keys "
            "twice, forged dead letters, routing-key mismatches, id collisions",
            consumers=2,
            mix_in={
                Kind.HEADERS_TOO_DEEP: p.hostile,
                Kind.TOO_COMPLEX: p.hostile,
                Kind.HOSTILE_HEADERS: 2 * p.hostile,
                Kind.HOSTILE_HEADERS_PERMANENT: 2 * p.hostile,
                Kind.FORGED_HEADERS: p.hostile,
                Kind.BODY_TOO_LARGE: p.oversized,
                Kind.HEADERS_TOO_LARGE: p.hostile,
                Kind.HEADERS_UNREADABLE: p.hostile,
                Kind.FORGED_DEAD_LETTER: p.hostile,
                Kind.ROUTING_KEY_MISMATCH: p.hostile,
                Kind.ID_CONFLICT: p.hostile,
            },
            settings={"hard_timeout": MEASURING_HARD_TIMEOUT},
            supervised=True,
            keeps_broker_links=True,
            events=p.hostile_events,
            measures=True,
        ),
        Scenario(
            "receipt-pruning",
            f"receipts kept {RECEIPT_WINDOW['receipt_retention']} in 1s partitions, pruned "
            "every second by whichever of 2 consumers holds the lock, duplicates around each prune",
            consumers=2,
            settings=RECEIPT_WINDOW,
            database_setup=SECOND_PARTITIONS,
            expired_copies=True,
            events=p.pruning_events,
        ),
        Scenario(
            "broker-alarm",
            f"RabbitMQ resource alarm {p.alarm_s:g}s x{p.alarms}",
            faults=[
                BrokerAlarm(p.alarm_s, "memory" if n % 2 == 0 else "disk") for n in range(p.alarms)
            ],
        ),
        queue_table(profile),
        *queue_table_alone(profile),
        queue_table_processes(profile),
        *beyond_one_machine(profile),
        *sharded(profile),
        *in_the_lab(profile),
        *skewed_clocks(profile),
        *outbox_scenarios(profile),
    ]


OUTBOX_SETTINGS = {"handlers": f"{TEST_HANDLERS},{OUTBOX_HANDLERS}"}
"""The outbox scenarios' handlers: the test handlers and the outbox causes' and follow-ups'."""
OUTBOX_SHARES = {Kind.OUTBOX: 0.15, Kind.OUTBOX_FLAKY: 0.03, Kind.OUTBOX_PERMANENT: 0.02}
"""The outbox causes, as shares of a scenario's publications, mixed into the normal stream: about
a fifth of the events publish 1 to 3 follow-ups each (about 40% more effects)."""
EXIT_SIGKILL = -signal.SIGKILL
"""What a process that SIGKILLed itself exits with, as :mod:`subprocess` reports it."""


def outbox_mix(events: int) -> dict[Kind, int]:
    """The outbox causes of a scenario of ``events`` publications (:data:`OUTBOX_SHARES`)."""
    return {kind: max(1, round(share * events)) for kind, share in OUTBOX_SHARES.items()}


def outbox_scenarios(profile: Profile) -> list[Scenario]:
    """The transactional outbox's promise (issue 34) under faults: handlers publish follow-ups in
    their own transaction (some then fail, once or for good), the relays publish them, and the
    checks follow every follow-up id (:func:`~tests.chaos.verify.check_outbox`)."""
    p = profile
    events = p.outbox_events or p.events
    mix = outbox_mix(events)
    causes = "handlers publish 1-3 follow-ups (some then fail once, some for good)"

    def outbox(slug: str, title: str, **more: Any) -> Scenario:
        return Scenario(
            slug,
            f"outbox: {title}; {causes}",
            settings=OUTBOX_SETTINGS,
            mix_in=mix,
            events=events,
            **more,
        )

    return [
        outbox(
            "outbox-relay-kill",
            f"the relay SIGKILLed between a confirm and the mark x{p.relay_kills}, restarted",
            faults=[RelayKill()] * p.relay_kills,
            self_exits=frozenset({EXIT_SIGKILL}),
            wraps_relay=True,
        ),
        outbox(
            "outbox-rabbit-restart",
            f"RabbitMQ restart x{p.rabbit_restarts} while the relay publishes",
            faults=[RestartRabbit()] * p.rabbit_restarts,
        ),
        outbox(
            "outbox-postgres-restart",
            f"PostgreSQL restart x{p.postgres_restarts} while the relay publishes",
            faults=[RestartPostgres()] * p.postgres_restarts,
        ),
        outbox(
            "outbox-replicas",
            "2 consumers, both relays on, sharing the rows (SKIP LOCKED)",
            consumers=2,
            relays_all=True,
        ),
    ]


THREE_QUEUES = """
# The handler faults' types: a crash loop, stalls and a dead-lettering storm land here.
[queues.faulty]
types = ["test.behave", "test.odd"]
prefetch = 20
handler_timeout = "5s"
hard_timeout = "10s"

[queues.batch]
types = ["test.behave_many"]
prefetch = 20

[queues.stock]
types = ["inventory.restock", "inventory.reserve", "notification.requested"]
prefetch = 20
"""
"""``queue-table``'s table: the workload's types over three queues; poison under
``test.behave``'s key and the unknown type (bound by the runner) go to ``faulty`` too. A prefetch
of 20 each: every delivery a process held comes back after its death and is applied isolated, one
at a time for the whole process (crash attribution), so a death costs what the queues held."""
FAULTY = "faulty"
TABLE_EVENTS = 800
TABLE_RATE = 60.0
"""``queue-table``'s publications in the short profile, and a second: over about 13s, so that
the faulty queue's trouble lasts a few seconds of a steady stream, few enough that the isolated
re-runs after each death (one at a time) end within :data:`TABLE_SETTLE` on a loaded machine."""
TABLE_SETTLE = 120.0


def _on_the_table(p: Profile) -> dict[str, Any]:
    """What every ``queue-table*`` scenario shares: the table, its faulty queue, where its trouble
    goes in the stream, and the short profile's pace."""
    short = p.name == "short"
    return {
        "queue_table": THREE_QUEUES,
        "faulty_queue": FAULTY,
        "trouble": (0.25, 0.55),
        "rate": TABLE_RATE if short else None,
        "events": TABLE_EVENTS if short else None,
        "settle_timeout": TABLE_SETTLE if short else None,
    }


def queue_table(profile: Profile) -> Scenario:
    """Three queues of one process, one of them in trouble (a crash loop, stalled handlers, a
    dead-lettering storm, gathered between 25% and 55% of the stream), then a SIGKILL and a
    broker connection drop."""
    p = profile
    return Scenario(
        "queue-table",
        f"queue table of 3 queues, 1 consumer: in queue {FAULTY}, {p.crashes} crash loops, "
        f"{p.stalls} stalled handlers, a storm of {p.storm} dead letters; then SIGKILL, "
        "broker closes all connections",
        faults=[Kill(), CloseConnections()],
        shares=(0.65, 0.8),
        mix_in={Kind.CRASH: p.crashes, Kind.STALL: p.stalls, Kind.ODD_POISON: p.storm},
        self_exits=frozenset({EXIT_CRASH}),
        **_on_the_table(p),
    )


def queue_table_alone(profile: Profile) -> list[Scenario]:
    """:func:`queue_table`'s table with one trouble in its faulty queue, and nothing else."""
    p = profile
    troubles = (
        ("stall", f"{p.stalls} stalled handlers", {Kind.STALL: p.stalls}),
        ("storm", f"a storm of {p.storm} dead letters", {Kind.ODD_POISON: p.storm}),
    )
    return [
        Scenario(
            f"queue-table-{name}",
            f"queue table of 3 queues, 1 consumer: in queue {FAULTY}, {what}, nothing else",
            mix_in=mix_in,
            **_on_the_table(p),
        )
        for name, what, mix_in in troubles
    ]


def queue_table_processes(profile: Profile) -> Scenario:
    """:func:`queue_table` with the faulty queue in a process of its own and the other two in
    another: the crash loops end only the faulty queue's process. The SIGKILL is that process's
    too; the broker's connection drop hits both."""
    p = profile
    processes = (FAULTY, "batch,stock")
    return Scenario(
        QUEUE_TABLE_PROCESSES,
        f"queue table of 3 queues over 2 processes (--queues {' / --queues '.join(processes)}): "
        f"in queue {FAULTY}, {p.crashes} crash loops, {p.stalls} stalled handlers, a storm of "
        f"{p.storm} dead letters; then SIGKILL of {FAULTY}'s process, broker closes all "
        "connections",
        consumers=len(processes),
        processes=processes,
        faults=[Kill(0), CloseConnections()],
        shares=(0.65, 0.8),
        mix_in={Kind.CRASH: p.crashes, Kind.STALL: p.stalls, Kind.ODD_POISON: p.storm},
        self_exits=frozenset({EXIT_CRASH}),
        **_on_the_table(p),
    )


CLOCK_SETTINGS = {"receipt_prune_interval": "1s"}
"""Prune rounds every second: each measures the clocks' difference again."""


def skewed_clocks(profile: Profile) -> list[Scenario]:
    """The consumers' clock 10 minutes ahead of the database's and 10 minutes behind, moved while
    they run under the handler-fault workload (the kinds that leave the process running: a
    consumer restarted on a clock 10 minutes off refuses to start, which
    tests/integration/test_clock_skew.py checks)."""
    p = profile
    return [
        Scenario(
            f"clock-{name}",
            f"the consumers' clock moved {offset} from the database's under load, 2 consumers, "
            "handler faults",
            consumers=2,
            faults=[SkewClock(offset)],
            settings=CLOCK_SETTINGS,
            mix_in=lab_handler_faults(p),
            faked_clock=True,
            events=p.net_events,
        )
        for name, offset in (("ahead", "+10m"), ("behind", "-10m"))
    ]


def lab_handler_faults(profile: Profile) -> dict[Kind, int]:
    """The handler faults that leave the process running (swallowed errors, odd payloads,
    killed database connections). Not those that end it (``block``, ``crash``): a consumer
    restarted during a cut fails to connect, and that, not the running consumers' noticing, would
    be the first ``lost RabbitMQ`` line, the time to detect; and one restarted on a skewed clock
    refuses to start."""
    scale = 1 if profile.name == "short" else 10
    return {
        Kind.SWALLOW: 10 * scale,
        Kind.ODD_POISON: 5 * scale,
        Kind.ODD: 5 * scale,
        Kind.KILL_CONNECTION: 2 * scale,
    }


def in_the_lab(profile: Profile) -> list[Scenario]:
    """The network-fault scenarios, each under :func:`lab_handler_faults`."""
    p = profile
    handler_faults = lab_handler_faults(p)
    degrade = Degrade(DEGRADED_S if p.name == "short" else 300.0)
    # The stream outlasts the fault, which strikes at 40% of it: a clean stretch before it, its
    # seconds, and a little after.
    degraded_events = round(DEGRADED_RATE * degrade.seconds * 2)

    def in_lab(
        slug: str,
        title: str,
        fault: Fault | None,
        amqp_query: str = "",
        settings: dict[str, str] | None = None,
        lost_event: str = "lost RabbitMQ",
        loses_commit_replies: bool = False,
        via_proxy: bool = False,
    ) -> Scenario:
        return Scenario(
            slug,
            f"network lab, 2 consumers, handler faults: {title}",
            consumers=2,
            faults=[] if fault is None else [fault],
            mix_in=handler_faults,
            site="net",
            amqp_query=amqp_query,
            settings=settings or {},
            lost_event=lost_event,
            loses_commit_replies=loses_commit_replies,
            via_proxy=via_proxy,
            events=degraded_events if via_proxy else p.net_events,
            rate=DEGRADED_RATE if via_proxy else None,
        )

    return [
        in_lab(
            "net-broker-cut",
            f"silent cut service<->RabbitMQ {BROKER_CUT_S:g}s (default heartbeat)",
            Cut("service", "rabbit", BROKER_CUT_S),
        ),
        in_lab(
            "net-broker-cut-heartbeat",
            f"silent cut service<->RabbitMQ {LONG_BROKER_CUT_S:g}s, past a "
            f"{SHORT_HEARTBEAT}s heartbeat",
            Cut("service", "rabbit", LONG_BROKER_CUT_S),
            amqp_query=f"?heartbeat={SHORT_HEARTBEAT}",
        ),
        in_lab(
            "net-pg-reply-lost",
            f"a COMMIT arrives, PostgreSQL's reply and all it sends after are dropped "
            f"{DATABASE_CUT_S:g}s",
            CommitCut("reply", DATABASE_CUT_S),
            settings={"hard_timeout": HARD_TIMEOUT},
            lost_event=DATABASE_LOST,
            loses_commit_replies=True,
        ),
        in_lab(
            "net-pg-request-lost",
            f"a COMMIT and all the service sends PostgreSQL after it dropped {DATABASE_CUT_S:g}s "
            "(the sessions left open in their transactions)",
            CommitCut("request", DATABASE_CUT_S),
            settings={"hard_timeout": HARD_TIMEOUT},
            lost_event=DATABASE_LOST,
        ),
        in_lab(
            "net-latency-loss",
            f"through the proxy; every link {degrade.delay_ms}±{degrade.jitter_ms}ms and "
            f"{degrade.loss_percent}% loss {degrade.seconds:g}s",
            degrade,
            via_proxy=True,
        ),
        in_lab(
            "net-clean", "through the proxy, no fault (the figures beside)", None, via_proxy=True
        ),
        *partitioned(profile),
    ]


def partitioned(profile: Profile) -> list[Scenario]:
    """The lab cluster's: one node cut off from the other two while consumer-0 is connected to it,
    a follower of the work queue, and while it leads the work queue (consumer-0's node list starts
    at the first node, the leader)."""
    p = profile
    seconds = p.node_partition_s
    # The stream flows through the cut (the fault does not hold it at its gate): in the short
    # profile at PARTITION_RATE, long enough to span the cut, the fault at 40% of it.
    short = p.name == "short"

    def cut_off(slug: str, title: str, fault: NodePartition, first_node: int) -> Scenario:
        return Scenario(
            slug,
            f"network lab, 3-node cluster, 2 consumers, handler faults: {title}",
            consumers=2,
            faults=[fault],
            mix_in=lab_handler_faults(p),
            site="net-cluster",
            settings=CLUSTER_SETTINGS,
            events=round(PARTITION_RATE * seconds * 2.5) if short else p.net_events,
            rate=PARTITION_RATE if short else None,
            first_node=first_node,
        )

    return [
        cut_off(
            "net-node-partition",
            f"consumer-0's node (a follower) cut off from its 2 peers {seconds:g}s",
            NodePartition(seconds, "connected"),
            first_node=1,
        ),
        cut_off(
            "net-node-partition-leader",
            f"consumer-0's node, the work queue's leader, cut off from its 2 peers {seconds:g}s",
            NodePartition(seconds, "leader", on_leader=True),
            first_node=0,
        ),
    ]


def beyond_one_machine(profile: Profile) -> list[Scenario]:
    """The cluster and failover scenarios (see :data:`Site`)."""
    p = profile

    def on_cluster(slug: str, title: str, fault: Fault, consumers: int = 1) -> Scenario:
        return Scenario(
            slug,
            f"cluster: {title}",
            consumers=consumers,
            faults=[fault],
            settings=CLUSTER_SETTINGS,
            site="cluster",
            events=p.cluster_events,
        )

    return [
        on_cluster(
            "cluster-leader-kill", "SIGKILL of the work queue's leader + restart", KillNode()
        ),
        on_cluster(
            "cluster-node-freeze",
            f"SIGSTOP of the leader node {p.node_freeze_s:g}s",
            FreezeNode(p.node_freeze_s),
        ),
        on_cluster("cluster-rolling-restart", "rolling restart of the 3 nodes", RollingRestart()),
        on_cluster(
            "cluster-connected-node-kill",
            "SIGKILL of the node the consumer is connected to + restart",
            KillNode("connected"),
        ),
        on_cluster(
            "cluster-scale-out",
            "3 consumers, one per node; SIGKILL of the leader + restart",
            KillNode(),
            consumers=3,
        ),
        Scenario(
            "pg-failover-sync",
            "PostgreSQL failover: synchronous standby 2s behind, primary SIGKILLed",
            faults=[FailoverPostgres()],
            site="pg-sync",
            events=p.cluster_events,
        ),
        Scenario(
            "pg-failover-async",
            "PostgreSQL failover: asynchronous standby 2s behind, primary SIGKILLed "
            "(losses reported)",
            faults=[FailoverPostgres()],
            site="pg-async",
            events=p.cluster_events,
            losses_reported=True,
        ),
    ]


def chosen(profile: Profile, only: Sequence[str] = ()) -> list[Scenario]:
    """The scenarios a run of ``profile`` runs: ``only`` those if named, else all but the
    profile's ``named_only``."""
    every = scenarios_for(profile)
    unknown = set(only) - {scenario.slug for scenario in every}
    if unknown:
        raise ValueError(f"no such scenario: {', '.join(sorted(unknown))}")
    if only:
        return [scenario for scenario in every if scenario.slug in only]
    return [scenario for scenario in every if scenario.slug not in profile.named_only]


SHARDS = 3
SHARDED_QUEUE = "sharded"
SHARDED_TABLE = f"""
# Every type of the test handlers, in one queue spread over {SHARDS} shards by key.
[queues.{SHARDED_QUEUE}]
types = ["test.behave", "test.behave_many", "test.odd", "inventory.restock", "inventory.reserve",
         "notification.requested"]
shards = {SHARDS}
"""
"""The sharded scenarios' table: the whole workload through the shards (poison and the unknown
type too: the runner binds it to the queue's hash exchange)."""


def sharded(profile: Profile) -> list[Scenario]:
    """:func:`beyond_one_machine`'s leader kill and node freeze with the work queue in
    :data:`SHARDS` shards, each led by the node the balanced locator gave it: the fault strikes
    the node leading the most shards among those consumer-0 is not connected to
    (:func:`~tests.chaos.shards.pick_shard_leader`). The stream is not held while the node is
    down or frozen: the shards it does not lead keep taking events, and the report gives each
    shard's longest pause in commits from the strike on."""
    p = profile
    faults: list[tuple[str, str, Fault]] = [
        (
            "leader-kill",
            "SIGKILL of a shard's leader node + restart, the stream flowing",
            KillNode("shard-leader", flowing=True),
        ),
        (
            "node-freeze",
            f"SIGSTOP of a shard's leader node {p.node_freeze_s:g}s, the stream flowing",
            FreezeNode(p.node_freeze_s, "shard-leader", flowing=True),
        ),
    ]
    return [
        Scenario(
            f"cluster-shards-{name}",
            f"cluster, work queue in {SHARDS} shards: {title}",
            faults=[fault],
            settings=CLUSTER_SETTINGS,
            site="cluster",
            events=p.cluster_events,
            queue_table=SHARDED_TABLE,
            faulty_queue=SHARDED_QUEUE,
        )
        for name, title, fault in faults
    ]
