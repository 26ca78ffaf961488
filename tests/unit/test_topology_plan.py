from consumer.config.settings import Settings
from consumer.service.components import topology_for
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
