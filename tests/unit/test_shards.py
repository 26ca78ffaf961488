"""Sharded work queues, step 1: ``shards`` in the queue table, the plan it gives (a consistent-hash
exchange over N quorum shard queues, each shard's retries back to it), and the shard key the
publisher sets. Pure: no broker."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumer.amqp.headers import trusted_headers
from consumer.cli.main import _handlers_if_loadable
from consumer.cli.producer import event_properties, shard_key
from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.config.settings import Settings
from consumer.errors import QueueTableError
from consumer.registry import HandlerRegistry
from consumer.service.components import table_specs, table_topology
from topology.apply import ExchangeTypeMissing
from topology.bindings import compare_bindings
from topology.migration_plan import MigrationRefused
from topology.model import Binding, Exchange, ExchangeType, Topology
from topology.names import Names
from topology.plan import TopologySpec
from topology.table_migration import plan_table_migration

SETTINGS = Settings.model_validate({"name": "svc", "retry_delays": "1s,5s"})

TABLE = """
[queues.orders]
types = ["inventory.reserve", "inventory.restock"]
shards = 3

[queues.sms]
types = ["notification.requested"]
"""


def table(tmp_path: Path, text: str = TABLE) -> QueueTable:
    path = tmp_path / "queues.toml"
    path.write_text(text)
    return read_queue_table(path, SETTINGS)


def sharded(tmp_path: Path) -> Topology:
    return table_topology(table(tmp_path))


# -- the queue table ------------------------------------------------------------------------------


def test_shards_is_a_queue_s_own_key_and_one_by_default(tmp_path: Path) -> None:
    queues = {queue.label: queue for queue in table(tmp_path).queues}

    assert queues["orders"].shards == 3
    assert queues["sms"].shards == 1
    assert [queue.label for queue in table(tmp_path).sharded] == ["orders"]
    # not a setting: the queue's settings are the service's
    assert queues["orders"].overrides == ()


@pytest.mark.parametrize(
    ("value", "shown"),
    [("0", "0"), ("65", "65"), ('"3"', "'3'"), ("true", "true"), ("2.5", "2.5"), ("-1", "-1")],
)
def test_a_bad_shard_count_stops_start_up_naming_file_queue_and_key(
    tmp_path: Path, value: str, shown: str
) -> None:
    path = tmp_path / "queues.toml"
    path.write_text(f'[queues.orders]\ntypes = ["a.b"]\nshards = {value}\n')

    with pytest.raises(QueueTableError) as raised:
        read_queue_table(path, SETTINGS)

    assert str(raised.value) == (
        f"invalid queue table {path}: queue orders: shards: must be a whole number from 1 to 64 "
        f"(got {shown})"
    )


def test_a_misspelt_shards_is_an_unknown_key(tmp_path: Path) -> None:
    path = tmp_path / "queues.toml"
    path.write_text('[queues.orders]\ntypes = ["a.b"]\nshard = 3\n')

    with pytest.raises(QueueTableError, match=r"shard: unknown key \(did you mean shards\?\)"):
        read_queue_table(path, SETTINGS)


def test_one_shard_is_today_s_single_queue_with_today_s_names(tmp_path: Path) -> None:
    one = table(tmp_path, TABLE.replace("shards = 3", "shards = 1"))
    plain = table(tmp_path, TABLE.replace("shards = 3", ""))

    assert table_topology(one) == table_topology(plain)
    assert "svc.orders.work" in {queue.name for queue in table_topology(one).queues}


# -- the plan -------------------------------------------------------------------------------------


def test_n_quorum_shard_queues_with_the_work_queue_s_arguments_and_balanced_leaders(
    tmp_path: Path,
) -> None:
    queues = {queue.name: queue for queue in sharded(tmp_path).queues}

    shards = [name for name in queues if name.startswith("svc.orders.work")]
    assert shards == ["svc.orders.work.s1", "svc.orders.work.s2", "svc.orders.work.s3"]
    for name in shards:
        arguments = dict(queues[name].arguments)
        assert queues[name].declare_arguments["x-queue-type"] == "quorum"
        assert arguments["x-dead-letter-exchange"] == "svc.orders.dlx"
        assert arguments["x-delivery-limit"] == 20
        assert arguments["x-dead-letter-strategy"] == "at-least-once"
        assert arguments["x-queue-leader-locator"] == "balanced"
    # one ladder and one dead-letter queue for the queue, the unsharded queue untouched
    assert {"svc.orders.dead", "svc.orders.retry.1s", "svc.orders.retry.5s"} <= set(queues)
    assert "x-queue-leader-locator" not in queues["svc.orders.dead"].arguments
    assert "x-queue-leader-locator" not in queues["svc.sms.work"].arguments
    assert queues["svc.orders.retry.5s"].arguments["x-dead-letter-exchange"] == (
        "svc.orders.redeliver"
    )


def test_the_hash_exchange_hashes_the_shard_key_header_and_redeliver_routes_on_headers(
    tmp_path: Path,
) -> None:
    exchanges = {exchange.name: exchange for exchange in sharded(tmp_path).exchanges}

    hashing = exchanges["svc.orders.hash"]
    assert hashing.type is ExchangeType.CONSISTENT_HASH
    assert dict(hashing.arguments) == {"hash-header": "consumer-shard-key"}
    assert hashing.plugin == "rabbitmq_consistent_hash_exchange"
    assert exchanges["svc.orders.redeliver"].type is ExchangeType.HEADERS
    assert exchanges["svc.sms.redeliver"].type is ExchangeType.FANOUT
    assert exchanges["svc.orders.dlx"].plugin is None
    assert "svc.sms.hash" not in exchanges


def test_types_go_to_the_hash_exchange_then_to_each_shard_and_retries_to_their_own(
    tmp_path: Path,
) -> None:
    bindings = sharded(tmp_path).bindings

    ingress = [b for b in bindings if b.exchange == "events" and b.queue.startswith("svc.orders")]
    assert [(b.queue, b.routing_key, b.to_exchange) for b in ingress] == [
        ("svc.orders.hash", "inventory.reserve", True),
        ("svc.orders.hash", "inventory.restock", True),
    ]
    hashed = [(b.queue, b.routing_key) for b in bindings if b.exchange == "svc.orders.hash"]
    assert hashed == [(f"svc.orders.work.s{i}", "1") for i in (1, 2, 3)]
    back = {b.queue: dict(b.arguments) for b in bindings if b.exchange == "svc.orders.redeliver"}
    assert back == {
        f"svc.orders.work.s{i}": {"x-match": "all", "consumer-shard": f"s{i}"} for i in (1, 2, 3)
    }
    # no type goes to a shard directly, the dead-letter queue stays one
    assert not [b for b in bindings if b.exchange == "events" and ".work.s" in b.queue]
    assert [b.queue for b in bindings if b.exchange == "svc.orders.dlx"] == ["svc.orders.dead"]


def test_the_plan_prints_the_exchange_binding_and_the_hash_argument(tmp_path: Path) -> None:
    lines = sharded(tmp_path).describe()

    assert (
        "exchange svc.orders.hash (x-consistent-hash, durable; hash-header=consumer-shard-key)"
        in lines
    )
    assert "bind events -> svc.orders.hash with routing key 'inventory.reserve' (exchange)" in lines


def test_a_work_queue_version_names_its_shards(tmp_path: Path) -> None:
    versioned = table(tmp_path, TABLE.replace("shards = 3", "shards = 2\nwork_queue_version = 2"))

    names = {queue.name for queue in table_topology(versioned).queues}

    assert {"svc.orders.work.v2.s1", "svc.orders.work.v2.s2"} <= names


def test_the_spec_lists_its_work_queues_and_refuses_a_shard_count_out_of_range() -> None:
    names = Names("svc", "events", queue="q")
    assert TopologySpec(names, (), 20, ("a.b",)).work_queues == ("svc.q.work",)
    assert TopologySpec(names, (), 20, ("a.b",), shards=2).work_queues == (
        "svc.q.work.s1",
        "svc.q.work.s2",
    )
    for bad in (0, 65):
        with pytest.raises(ValueError, match="shards must be 1 to 64"):
            TopologySpec(names, (), 20, ("a.b",), shards=bad)


def test_the_table_s_specs_carry_each_queue_s_shards(tmp_path: Path) -> None:
    specs = {spec.names.queue: spec for spec in table_specs(table(tmp_path))}

    assert specs["orders"].shards == 3
    assert specs["sms"].shards == 1


# -- check: the bindings --------------------------------------------------------------------------


def test_a_missing_exchange_binding_and_a_missing_shard_binding_are_named(
    tmp_path: Path,
) -> None:
    plan = sharded(tmp_path)
    present = [
        b
        for b in plan.bindings
        if not (b.to_exchange and b.routing_key == "inventory.reserve")
        and b.queue != "svc.orders.work.s2"
    ]

    lines = compare_bindings(plan, present).describe()

    assert lines == [
        "missing: bind svc.orders.hash -> svc.orders.work.s2 with routing key '1'",
        "missing: bind events -> svc.orders.hash with routing key 'inventory.reserve' (exchange)",
        "missing: bind svc.orders.redeliver -> svc.orders.work.s2 where "
        "{'x-match': 'all', 'consumer-shard': 's2'}",
    ]


def test_a_queue_binding_is_not_an_exchange_binding_of_the_same_names(tmp_path: Path) -> None:
    plan = sharded(tmp_path)
    as_queue = [
        Binding(b.exchange, b.queue, b.routing_key, b.arguments) if b.to_exchange else b
        for b in plan.bindings
    ]

    differences = compare_bindings(plan, as_queue)

    assert len(differences.missing) == 2  # both types' exchange bindings
    assert differences.unplanned == ()  # svc.orders.hash is no queue of the plan


def test_a_type_still_bound_to_the_hash_exchange_is_not_in_the_plan(tmp_path: Path) -> None:
    plan = sharded(tmp_path)
    stale = Binding("events", "svc.orders.hash", "notification.requested", to_exchange=True)

    differences = compare_bindings(plan, [*plan.bindings, stale])

    assert differences.describe() == [
        "not in the plan: bind events -> svc.orders.hash with routing key "
        "'notification.requested' (exchange)"
    ]


# -- the plugin -----------------------------------------------------------------------------------


def test_the_missing_plugin_is_one_line_that_names_it() -> None:
    exchange = Exchange("svc.orders.hash", ExchangeType.CONSISTENT_HASH)

    line = str(ExchangeTypeMissing(exchange))

    assert "\n" not in line
    assert line == (
        "RabbitMQ has no exchange type x-consistent-hash, which svc.orders.hash needs: enable the "
        "plugin rabbitmq_consistent_hash_exchange on every node (rabbitmq-plugins enable "
        "rabbitmq_consistent_hash_exchange), then apply again"
    )


# -- migrate --------------------------------------------------------------------------------------


def test_sharding_an_unsharded_queue_is_refused_with_one_line(tmp_path: Path) -> None:
    specs = table_specs(table(tmp_path))

    with pytest.raises(MigrationRefused) as refused:
        plan_table_migration([build_spec(spec) for spec in specs], specs)

    assert str(refused.value) == (
        "queue orders: from shards = 1 to 3 is not built: an unsharded queue's redeliver "
        "exchange is fanout, a sharded one's headers, and RabbitMQ cannot change an exchange's "
        "type; reshard between 2 or more shards"
    )


def build_spec(spec: TopologySpec) -> TopologySpec:
    """The same queue unsharded: the table the install had before."""
    return TopologySpec(spec.names, spec.retry_delays, spec.delivery_limit, spec.event_types)


# -- the publisher's shard key --------------------------------------------------------------------


def registry() -> HandlerRegistry:
    return HandlerRegistry.from_modules(["consumer.handlers.inventory"])


def test_the_shard_key_is_the_handler_s_key_of_the_payload() -> None:
    handlers = registry()
    key = handlers["inventory.reserve"].key
    assert key is not None  # the reference handler locks its SKU
    payload = {"order_id": "o-1", "sku": "SKU-7", "qty": 1}

    assert shard_key(handlers, "inventory.reserve", payload) == "SKU-7"


def test_no_key_means_the_event_id_stands_in() -> None:
    # a type no handler takes, no registry, a payload its model refuses
    assert shard_key(registry(), "no.such", {}) is None
    assert shard_key(None, "inventory.reserve", {"sku": "SKU-7"}) is None
    assert shard_key(registry(), "inventory.reserve", {"sku": "SKU-7", "qty": "x"}) is None


def test_the_properties_carry_the_header_the_hash_exchange_hashes() -> None:
    properties = event_properties(message_id="m", shard_key="SKU-7")

    assert properties.headers == {"consumer-shard-key": "SKU-7"}
    assert event_properties(message_id="m").headers is None


def test_a_producer_s_shard_key_survives_arrival_and_its_shard_header_does_not() -> None:
    kept = trusted_headers(
        {"consumer-shard-key": "SKU-7", "consumer-shard": "s9", "consumer-attempt": 3},
        trusted=False,
    )

    assert kept == {"consumer-shard-key": "SKU-7"}


# -- the order apply binds in ------------------------------------------------------------------


def test_each_shard_is_bound_to_the_hash_exchange_before_any_type_is_routed_to_it(
    tmp_path: Path,
) -> None:
    # apply binds in the plan's order: a type bound to the hash exchange before the hash exchange
    # has a shard makes that type's events unroutable (dropped) while apply runs
    bindings = list(sharded(tmp_path).bindings)
    to_hash = [i for i, b in enumerate(bindings) if b.queue == "svc.orders.hash"]
    to_shards = [i for i, b in enumerate(bindings) if b.exchange == "svc.orders.hash"]

    assert max(to_shards) < min(to_hash)


def test_a_hash_exchange_s_binding_to_a_shard_the_plan_has_not_is_named(tmp_path: Path) -> None:
    # a table gone from 3 shards to 2: the hash exchange still sends a share of the keys to s3
    plan = table_topology(table(tmp_path, TABLE.replace("shards = 3", "shards = 2")))
    leftover = Binding("svc.orders.hash", "svc.orders.work.s3", "1")

    differences = compare_bindings(plan, [*plan.bindings, leftover])

    assert differences.describe() == [
        "not in the plan: bind svc.orders.hash -> svc.orders.work.s3 with routing key '1'"
    ]


def test_an_unsharded_plan_still_ignores_bindings_to_queues_it_has_not(tmp_path: Path) -> None:
    # the dead-letter exchange tapped by an operator's queue: not the service's to report
    plan = table_topology(table(tmp_path, TABLE.replace("shards = 3", "")))
    tap = Binding("svc.orders.dlx", "ops.tap", "")

    assert compare_bindings(plan, [*plan.bindings, tap]).describe() == []


def test_publish_no_check_sends_by_the_event_id_when_a_handler_module_fails_to_import(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # --no-check never loaded the handlers: the shard key alone must not make a module that
    # fails at import (not an ImportError) stop the publish
    (tmp_path / "broken_handlers_for_publish.py").write_text("raise RuntimeError('no DSN')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    settings = SETTINGS.model_copy(update={"handlers": ["broken_handlers_for_publish"]})

    assert _handlers_if_loadable(settings) is None
