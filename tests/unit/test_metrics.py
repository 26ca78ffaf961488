"""consumer.observe.metrics: what the service's registry exposes, without a process running."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest

from consumer.observe.metrics import Metrics, ServiceRegistry
from consumer.pipeline.outcome import OutcomeKind


def _exposition(registry: CollectorRegistry) -> str:
    return generate_latest(registry).decode()


def test_the_service_registry_leaves_out_created_series_and_keeps_the_rest() -> None:
    # Given the service's metrics, a counter and a histogram moved
    metrics = Metrics(ServiceRegistry(), ["example.type"], ["5s"], name="billing")
    metrics.count("example.type", OutcomeKind.PROCESSED)
    metrics.observe_handler("example.type", 0.01)

    # When it is scraped
    text = _exposition(metrics.registry)

    # Then no _created sample is there, and the counter and the histogram are
    assert "_created" not in text
    assert 'consumer_messages_total{outcome="processed",type="example.type"} 1.0' in text
    assert 'consumer_handler_duration_seconds_count{type="example.type"} 1.0' in text


def test_created_series_stay_on_other_registries() -> None:
    # The switch is per registry: prometheus_client's own default is left alone elsewhere.
    metrics = Metrics(CollectorRegistry(), ["example.type"])
    metrics.count("example.type", OutcomeKind.PROCESSED)

    assert "consumer_messages_created" in _exposition(metrics.registry)


def test_the_process_series_and_the_service_name_are_exported() -> None:
    metrics = Metrics(ServiceRegistry(), ["example.type"], name="billing")
    registry = metrics.registry

    start = registry.get_sample_value("process_start_time_seconds")
    assert start is not None
    assert start > 0
    assert registry.get_sample_value("process_resident_memory_bytes")
    assert registry.get_sample_value("consumer_service_info", {"name": "billing"}) == 1


def test_the_pool_maximum_is_exported_beside_its_use() -> None:
    metrics = Metrics(ServiceRegistry(), ["example.type"])

    metrics.watch_pool(lambda: 3, lambda: 2, 4)

    registry = metrics.registry
    assert registry.get_sample_value("consumer_db_pool_max") == 4
    assert registry.get_sample_value("consumer_db_pool_size") == 3
    assert registry.get_sample_value("consumer_db_pool_in_use") == 2
