"""The metrics of a queue table's queues exported as one: each queue's ``consumer_*`` series with
a ``queue`` label, the process's own series once.

Every queue has its own :class:`~consumer.observe.metrics.Metrics` on a registry of its own (the
parts of one queue's pipeline know nothing of the others); this registry merges them at scrape
time, so that a family appears once with every queue's samples, as Prometheus requires.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric

__all__ = ["QUEUE_LABEL", "QueueMetricsRegistry"]

QUEUE_LABEL = "queue"
_PER_QUEUE = "consumer_"


class QueueMetricsRegistry(CollectorRegistry):
    """What ``/metrics`` exposes for a queue table: ``registries`` by queue name."""

    def __init__(self, registries: Mapping[str, CollectorRegistry]) -> None:
        super().__init__(auto_describe=False)
        self._registries = dict(registries)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for index, (queue, registry) in enumerate(self._registries.items()):
            for metric in registry.collect():
                if not metric.name.startswith(_PER_QUEUE):
                    # The process's own series (process_*, python_info): every queue's registry
                    # has them, the same; exported once.
                    if index == 0:
                        merged[metric.name] = metric
                    continue
                samples = [
                    sample._replace(labels={**sample.labels, QUEUE_LABEL: queue})
                    for sample in metric.samples
                ]
                if metric.name in merged:
                    merged[metric.name].samples.extend(samples)
                else:
                    metric.samples = samples
                    merged[metric.name] = metric
        yield from merged.values()
