"""A queue table's metrics and readiness: each queue's series labelled with its queue, the
process's own once; ready when every queue is, each listed."""

from __future__ import annotations

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from consumer.observe.metrics import Metrics, ServiceRegistry
from consumer.observe.queue_metrics import QueueMetricsRegistry
from consumer.observe.readiness import QueuesReadiness, Readiness
from consumer.pipeline.outcome import OutcomeKind


def test_each_queue_s_series_carry_its_name_and_the_process_s_come_once() -> None:
    # Given two queues' metrics, each with its own count
    sms = Metrics(ServiceRegistry(), ["a.x"], name="svc")
    order = Metrics(ServiceRegistry(), ["b.x"], name="svc")
    sms.messages.labels(type="a.x", outcome=OutcomeKind.PROCESSED.value).inc(3)
    order.messages.labels(type="b.x", outcome=OutcomeKind.PROCESSED.value).inc(5)

    # When they are exported as one
    text = generate_latest(QueueMetricsRegistry({"sms": sms.registry, "order": order.registry}))

    # Then each family appears once, each queue's samples labelled with it
    families = {family.name: family for family in text_string_to_metric_families(text.decode())}
    assert text.decode().count("# TYPE consumer_messages_total counter") == 1
    counts = {
        (sample.labels["queue"], sample.labels["type"]): sample.value
        for sample in families["consumer_messages"].samples
        if sample.name == "consumer_messages_total" and sample.labels["outcome"] == "processed"
    }
    assert counts[("sms", "a.x")] == 3
    assert counts[("order", "b.x")] == 5
    assert ("sms", "b.x") not in counts
    starts = list(families["process_start_time_seconds"].samples)
    assert len(starts) == 1
    assert "queue" not in starts[0].labels


def test_a_table_is_ready_when_every_queue_is_and_lists_each() -> None:
    up = Readiness(broker_connected=True, consuming=True, database=True, paused=False)
    paused = Readiness(broker_connected=True, consuming=True, database=True, paused=True)

    assert QueuesReadiness({"a": up, "b": up}).ready
    state = QueuesReadiness({"a": up, "b": paused})
    assert not state.ready
    body = state.as_dict()
    assert body["paused"] is True
    assert body["consuming"] is True
    assert body["queues"]["a"]["ready"] is True
    assert body["queues"]["b"] == {**paused.as_dict(), "ready": False}
