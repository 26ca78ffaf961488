"""The scenarios' settings agree with what their workloads assume, and each profile runs what
its documentation says."""

from __future__ import annotations

import signal
import tomllib

from consumer.durations import parse_duration
from consumer.registry import HandlerRegistry
from tests.chaos.faults import FreezeNode, Kill, KillNode, RelayKill, RestartPostgres, RestartRabbit
from tests.chaos.netfaults import NodePartition
from tests.chaos.netsite import NET_TICKTIME
from tests.chaos.scenarios import (
    BEYOND_ONE,
    CONSUMER_SETTINGS,
    NET,
    NET_CLUSTER,
    NET_NAMED_ONLY,
    OUTBOX,
    PROFILES,
    QUEUE_TABLE_ALONE,
    QUEUE_TABLE_PROCESSES,
    SHARDED_CLUSTER,
    chosen,
    scenarios_for,
)
from tests.chaos.workload import (
    BLOCK_S,
    HANDLER_FAULTS,
    HOSTILE,
    MAX_QTY,
    MIX,
    OUTBOX_CAUSES,
    OUTBOX_HANDLERS,
    SEED_STOCK,
    SLOW_S,
    STALL_S,
    Kind,
    check_faults,
)
from tests.support import TEST_HANDLERS


def _seconds(text: str) -> float:
    return parse_duration(text).total_seconds()


def test_blocking_events_outlast_the_hard_limit_and_slow_ones_fit_the_handler_timeout() -> None:
    handler_timeout = _seconds(CONSUMER_SETTINGS["handler_timeout"])
    for scenario in scenarios_for(PROFILES["short"]):
        if Kind.BLOCK in scenario.mix_in:
            hard = _seconds(scenario.settings["hard_timeout"])
            assert handler_timeout < hard < BLOCK_S, scenario.slug
            assert scenario.self_exits, scenario.slug
        if Kind.CRASH in scenario.mix_in:
            assert 17 in scenario.self_exits, scenario.slug
        if Kind.SLOW_DUPLICATE in scenario.mix_in:
            stall = _seconds(scenario.settings["db_stall_timeout"])
            assert stall < SLOW_S < handler_timeout, scenario.slug
            assert scenario.never_pauses


def test_the_short_profile_runs_the_handler_faults_together_and_the_long_one_each_alone() -> None:
    short = {scenario.slug for scenario in chosen(PROFILES["short"])}
    long = {scenario.slug for scenario in chosen(PROFILES["long"])}
    every = {scenario.slug for scenario in scenarios_for(PROFILES["short"])}

    assert short == every - PROFILES["short"].named_only
    assert long == every - {"handler-faults"}
    assert {
        "handler-faults",
        "slow-duplicate",
        "broker-alarm",
        "hostile-producers",
        "queue-table",
    } <= short
    together = next(s for s in scenarios_for(PROFILES["short"]) if s.slug == "handler-faults")
    alone = set().union(*(set(s.mix_in) for s in scenarios_for(PROFILES["short"])))
    # A slow duplicate and a stalled handler (queue-table's, in its own queue) run on their own.
    alone = alone & HANDLER_FAULTS - {Kind.SLOW_DUPLICATE, Kind.STALL}
    assert set(together.mix_in) == alone
    assert alone | {Kind.SLOW_DUPLICATE, Kind.STALL} == HANDLER_FAULTS


def test_hostile_producers_mix_in_every_hostile_kind_under_a_supervisor() -> None:
    sizes = {}
    for name, profile in PROFILES.items():
        [hostile] = [s for s in scenarios_for(profile) if set(s.mix_in) & HOSTILE]
        assert hostile.slug == "hostile-producers"
        assert set(hostile.mix_in) == HOSTILE
        # Each of the four headers made safe, both applied and dead-lettered
        assert hostile.mix_in[Kind.HOSTILE_HEADERS] >= 4
        assert hostile.mix_in[Kind.HOSTILE_HEADERS_PERMANENT] >= 4
        assert hostile.supervised
        assert hostile.keeps_broker_links
        assert not hostile.faults
        assert not hostile.self_exits
        sizes[name] = hostile.events
    # Few events in the short profile (it runs in `make test`), the profile's in the long one
    assert sizes["short"] is not None
    assert sizes["short"] < PROFILES["short"].events
    assert sizes["long"] is None


def test_every_scenario_workload_fits_in_both_profiles() -> None:
    for profile in PROFILES.values():
        for scenario in scenarios_for(profile):
            check_faults(scenario.events or profile.events, scenario.mix_in)
        # Every reserve fits in the seeded stock of its SKU, whatever the order.
        assert profile.events * MIX[Kind.RESERVE] * MAX_QTY < SEED_STOCK


def test_the_long_profile_runs_every_cluster_and_failover_scenario_and_the_short_names_them() -> (
    None
):
    long = {scenario.slug for scenario in chosen(PROFILES["long"])}
    short = {scenario.slug for scenario in chosen(PROFILES["short"])}

    assert set(BEYOND_ONE) <= long
    assert not set(BEYOND_ONE) & short  # tests/integration/test_cluster.py covers them there
    for scenario in scenarios_for(PROFILES["long"]):
        if scenario.slug in BEYOND_ONE:
            assert scenario.site != "node", scenario.slug
            assert (scenario.events or PROFILES["long"].events) == 50_000, scenario.slug
            # Only the asynchronous standby is allowed to lose acked commits.
            assert scenario.losses_reported == (scenario.site == "pg-async"), scenario.slug
        elif scenario.slug in NET:
            assert scenario.site == "net", scenario.slug
        elif scenario.slug in NET_CLUSTER:
            assert scenario.site == "net-cluster", scenario.slug
        else:
            assert scenario.site == "node", scenario.slug


def test_the_network_lab_scenarios_run_all_in_the_long_profile_and_one_of_each_kind_short() -> None:
    long = [s for s in chosen(PROFILES["long"]) if s.site == "net"]
    short = [s for s in chosen(PROFILES["short"]) if s.site == "net"]

    assert {s.slug for s in long} == set(NET)
    # `make test`: one scenario of each kind of fault, the others when named
    kinds = {type(fault).__name__ for s in long for fault in s.faults}
    assert {type(fault).__name__ for s in short for fault in s.faults} == kinds
    assert {s.slug for s in short} == set(NET) - set(NET_NAMED_ONLY)
    for scenario in long:
        assert scenario.mix_in, scenario.slug  # under the handler-fault workload


def test_the_queue_table_scenario_puts_every_fault_in_its_faulty_queue() -> None:
    for profile in PROFILES.values():
        scenario = next(s for s in scenarios_for(profile) if s.slug == "queue-table")
        table = tomllib.loads(scenario.queue_table)["queues"]
        assert len(table) == 3
        faulty = table[scenario.faulty_queue]
        # The crash loop, the stalls and the storm are test.behave and test.odd events
        assert {"test.behave", "test.odd"} <= set(faulty["types"])
        assert {Kind.CRASH, Kind.STALL, Kind.ODD_POISON} == set(scenario.mix_in)
        assert _seconds(faulty["handler_timeout"]) > STALL_S
        assert 17 in scenario.self_exits
        assert len(scenario.shares) == len(scenario.faults)


def test_the_partition_scenarios_cut_consumer_0s_node_a_follower_short_and_the_leader_long() -> (
    None
):
    long = {s.slug: s for s in chosen(PROFILES["long"]) if s.site == "net-cluster"}
    short = [s.slug for s in chosen(PROFILES["short"]) if s.site == "net-cluster"]

    assert set(long) == set(NET_CLUSTER)
    # One of the kind in `make test`: the lab cluster's start is a minute or two
    assert short == ["net-node-partition"]
    follower, leader = long["net-node-partition"], long["net-node-partition-leader"]
    [cut] = follower.faults
    [cut_leader] = leader.faults
    assert isinstance(cut, NodePartition)
    assert isinstance(cut_leader, NodePartition)
    # consumer-0 starts past the first node (which declared, so leads, the work queue), and the
    # cut takes its node; the leader variant starts it at the first node and cuts the leader
    assert (follower.first_node, cut.target, cut.on_leader) == (1, "connected", False)
    assert (leader.first_node, cut_leader.target, cut_leader.on_leader) == (0, "leader", True)
    for scenario in long.values():
        assert scenario.mix_in, scenario.slug  # under the handler-fault workload
        assert scenario.settings["quorum_initial_group_size"] == "3"
        for profile in PROFILES.values():
            [fault] = next(s for s in scenarios_for(profile) if s.slug == scenario.slug).faults
            assert isinstance(fault, NodePartition)
            assert fault.seconds > NET_TICKTIME


def test_the_queue_table_s_troubles_alone_run_long_and_only_when_named_short() -> None:
    assert not [s for s in chosen(PROFILES["short"]) if s.slug in QUEUE_TABLE_ALONE]
    assert {s.slug for s in chosen(PROFILES["long"])} >= set(QUEUE_TABLE_ALONE)
    for profile in PROFILES.values():
        alone = [s for s in scenarios_for(profile) if s.slug in QUEUE_TABLE_ALONE]
        assert [s.slug for s in alone] == list(QUEUE_TABLE_ALONE)
        stall, storm = alone
        assert set(stall.mix_in) == {Kind.STALL}
        assert set(storm.mix_in) == {Kind.ODD_POISON}
        for scenario in alone:
            # Nothing kills the process: the other queues' rates show the trouble's cost alone
            assert not scenario.faults
            assert scenario.faulty_queue == "faulty"
            assert len(tomllib.loads(scenario.queue_table)["queues"]) == 3


def test_the_outbox_scenarios_run_one_short_and_all_long_with_their_causes_and_handlers() -> None:
    short = [s.slug for s in chosen(PROFILES["short"]) if s.slug in OUTBOX]
    long = [s.slug for s in chosen(PROFILES["long"]) if s.slug in OUTBOX]

    # `make test`: the relay killed in its window; the restarts and the replicas long only
    assert short == ["outbox-relay-kill"]
    assert long == list(OUTBOX)
    for profile in PROFILES.values():
        scenarios = {s.slug: s for s in scenarios_for(profile) if s.slug in OUTBOX}
        for scenario in scenarios.values():
            assert set(scenario.mix_in) == OUTBOX_CAUSES, scenario.slug
            assert OUTBOX_HANDLERS in scenario.settings["handlers"].split(","), scenario.slug
        kill = scenarios["outbox-relay-kill"]
        assert kill.wraps_relay
        assert kill.faults == [RelayKill()] * profile.relay_kills
        assert kill.self_exits == frozenset({-signal.SIGKILL})
        assert scenarios["outbox-replicas"].consumers == 2
        assert scenarios["outbox-replicas"].relays_all
        assert not any(s.wraps_relay for s in scenarios.values() if s is not kill)
        assert [type(f) for f in scenarios["outbox-rabbit-restart"].faults] == [RestartRabbit] * (
            profile.rabbit_restarts
        )
        assert [type(f) for f in scenarios["outbox-postgres-restart"].faults] == (
            [RestartPostgres] * profile.postgres_restarts
        )
    # No other scenario runs the outbox's handlers or wraps the relay: their behaviour unchanged
    for scenario in scenarios_for(PROFILES["long"]):
        if scenario.slug not in OUTBOX:
            assert not set(scenario.mix_in) & OUTBOX_CAUSES, scenario.slug
            assert "handlers" not in scenario.settings, scenario.slug
            assert not scenario.wraps_relay, scenario.slug


def test_the_queue_table_over_processes_has_queue_table_s_troubles_and_spares_the_others() -> None:
    assert QUEUE_TABLE_PROCESSES in PROFILES["short"].named_only
    assert QUEUE_TABLE_PROCESSES in {s.slug for s in chosen(PROFILES["long"])}
    for profile in PROFILES.values():
        every = {s.slug: s for s in scenarios_for(profile)}
        one, split = every["queue-table"], every[QUEUE_TABLE_PROCESSES]
        # The same table, troubles, stream and faults' shares as the one-process scenario
        assert (split.queue_table, split.faulty_queue, split.trouble) == (
            one.queue_table,
            one.faulty_queue,
            one.trouble,
        )
        assert (split.mix_in, split.events, split.rate, split.shares) == (
            one.mix_in,
            one.events,
            one.rate,
            one.shares,
        )
        assert split.self_exits == one.self_exits
        # Every queue of the table in exactly one process; the faulty queue alone in consumer-0,
        # which the SIGKILL takes
        queues = [name for names in split.processes for name in names.split(",")]
        assert sorted(queues) == sorted(tomllib.loads(split.queue_table)["queues"])
        assert split.processes[0] == split.faulty_queue
        assert split.consumers == len(split.processes) == 2
        kill = split.faults[0]
        assert isinstance(kill, Kill)
        assert kill.consumer == 0


def test_the_sharded_cluster_scenarios_strike_a_shard_leader_with_every_type_in_3_shards() -> None:
    # Long only, as the other cluster scenarios (named in the short profile)
    assert set(SHARDED_CLUSTER) <= set(BEYOND_ONE)
    handled = set(HandlerRegistry.from_modules(TEST_HANDLERS.split(",")))
    for profile in PROFILES.values():
        found = {s.slug: s for s in scenarios_for(profile) if s.slug in SHARDED_CLUSTER}
        assert list(found) == list(SHARDED_CLUSTER)
        kill, freeze = found.values()
        assert [type(f) for f in kill.faults] == [KillNode]
        assert [type(f) for f in freeze.faults] == [FreezeNode]
        for scenario in found.values():
            [fault] = scenario.faults
            assert isinstance(fault, KillNode | FreezeNode)
            assert fault.target == "shard-leader"
            assert fault.flowing  # the other shards keep taking events while it is down
            assert scenario.site == "cluster"
            [row] = tomllib.loads(scenario.queue_table)["queues"].values()
            # The whole workload through the shards, so every shard sees every kind
            assert row["shards"] == 3
            assert set(row["types"]) == handled
