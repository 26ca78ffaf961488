from pathlib import Path

from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.config.settings import Settings
from consumer.service.components import table_topology, topology_for
from topology.apply import _parse_value
from topology.model import ExchangeType, QueueType, Topology


def plan(**overrides: object) -> Topology:
    settings = Settings.model_validate({"name": "svc", "retry_delays": "1s,5s", **overrides})
    return topology_for(settings, ["b.type", "a.type"])


def test_work_queue_is_quorum_with_dead_lettering_and_a_delivery_limit() -> None:
    topology = plan(delivery_limit=3)
    work = next(queue for queue in topology.queues if queue.name == "svc.work")
    assert work.type is QueueType.QUORUM
    assert work.arguments["x-dead-letter-exchange"] == "svc.dlx"
    assert work.arguments["x-delivery-limit"] == 3
    assert work.arguments["x-dead-letter-strategy"] == "at-least-once"
    assert work.arguments["x-overflow"] == "reject-publish"


def test_one_delay_queue_per_rung_dead_lettering_back_through_our_own_exchange() -> None:
    topology = plan()
    rungs = {queue.name: queue for queue in topology.queues if ".retry." in queue.name}
    assert set(rungs) == {"svc.retry.1s", "svc.retry.5s"}
    assert rungs["svc.retry.5s"].arguments["x-message-ttl"] == 5000
    for rung in rungs.values():
        assert rung.arguments["x-dead-letter-exchange"] == "svc.redeliver"
        assert "x-dead-letter-routing-key" not in rung.arguments  # keeps the original key
    redeliver = [b for b in topology.bindings if b.exchange == "svc.redeliver"]
    assert [b.queue for b in redeliver] == ["svc.work"]


def test_bindings_one_per_handler_type_and_one_per_rung() -> None:
    topology = plan()
    ingress = [(b.queue, b.routing_key) for b in topology.bindings if b.exchange == "events"]
    assert ingress == [("svc.work", "a.type"), ("svc.work", "b.type")]
    retry = {b.queue: dict(b.arguments) for b in topology.bindings if b.exchange == "svc.retry"}
    assert retry["svc.retry.5s"] == {"x-match": "all", "consumer-retry-rung": "5s"}


def test_exchanges() -> None:
    kinds = {exchange.name: exchange.type for exchange in plan().exchanges}
    assert kinds == {
        "events": ExchangeType.TOPIC,
        "svc.dlx": ExchangeType.FANOUT,
        "svc.retry": ExchangeType.HEADERS,
        "svc.redeliver": ExchangeType.FANOUT,
    }


def test_the_plan_prints_one_line_per_declaration() -> None:
    topology = plan()
    lines = topology.describe()
    assert len(lines) == len(topology.exchanges) + len(topology.queues) + len(topology.bindings)
    assert lines[0] == "exchange events (topic, durable)"


def test_reads_rabbitmqs_descriptions_of_argument_values() -> None:
    assert _parse_value("'1000'") == ("1000", 1000)
    assert _parse_value("none") == ("none", None)
    assert _parse_value("the value '5' of type 'byte'") == ("5", 5)
    assert _parse_value("the value 'svc.dlx' of type 'longstr'") == ("svc.dlx", "svc.dlx")
    assert _parse_value("'true'") == ("true", True)


def test_quorum_group_size_is_the_brokers_default_unless_set() -> None:
    assert all("x-quorum-initial-group-size" not in q.arguments for q in plan().queues)
    sized = plan(quorum_initial_group_size=3)
    assert {q.arguments["x-quorum-initial-group-size"] for q in sized.queues} == {3}


def table_plan(tmp_path: Path) -> Topology:
    path = tmp_path / "queues.toml"
    path.write_text(
        '[queues.sms]\ntypes = ["b.type"]\n'
        '[queues.report]\ntypes = ["a.type", "c.type"]\nretry_delays = "1m"\n'
        "delivery_limit = 3\nwork_queue_version = 2\n"
    )
    settings = Settings.model_validate({"name": "svc", "retry_delays": "1s,5s"})
    return table_topology(read_queue_table(path, settings))


def test_each_queue_of_a_table_has_its_own_work_queue_ladder_and_dead_letter_queue(
    tmp_path: Path,
) -> None:
    topology = table_plan(tmp_path)

    assert sorted(queue.name for queue in topology.queues) == [
        "svc.report.dead",
        "svc.report.retry.1m",
        "svc.report.work.v2",
        "svc.sms.dead",
        "svc.sms.retry.1s",
        "svc.sms.retry.5s",
        "svc.sms.work",
    ]
    # the ingress exchange once, each queue's own exchanges
    assert [exchange.name for exchange in topology.exchanges] == [
        "events",
        "svc.sms.dlx",
        "svc.sms.retry",
        "svc.sms.redeliver",
        "svc.report.dlx",
        "svc.report.retry",
        "svc.report.redeliver",
    ]
    work = {queue.name: queue for queue in topology.queues}
    assert work["svc.report.work.v2"].arguments["x-delivery-limit"] == 3
    assert work["svc.report.work.v2"].arguments["x-dead-letter-exchange"] == "svc.report.dlx"
    assert work["svc.sms.work"].arguments["x-delivery-limit"] == 20
    assert work["svc.report.retry.1m"].arguments["x-dead-letter-exchange"] == (
        "svc.report.redeliver"
    )


def test_the_ingress_binds_each_queue_s_types_to_its_work_queue(tmp_path: Path) -> None:
    topology = table_plan(tmp_path)

    ingress = sorted((b.routing_key, b.queue) for b in topology.bindings if b.exchange == "events")
    assert ingress == [
        ("a.type", "svc.report.work.v2"),
        ("b.type", "svc.sms.work"),
        ("c.type", "svc.report.work.v2"),
    ]
    around = {(b.exchange, b.queue) for b in topology.bindings if not b.routing_key}
    assert ("svc.sms.redeliver", "svc.sms.work") in around
    assert ("svc.report.redeliver", "svc.report.work.v2") in around
    assert ("svc.sms.dlx", "svc.sms.dead") in around
    assert ("svc.report.dlx", "svc.report.dead") in around


def test_without_a_table_the_plan_is_today_s() -> None:
    settings = Settings.model_validate({"name": "svc", "retry_delays": "1s,5s"})
    default = table_topology(QueueTable.default(settings, ["b.type", "a.type"]))
    assert default == plan()
