"""deploy/grafana: the dashboard is well-formed and reads only metrics the service exports.

No Grafana runs here. The JSON's structure is checked below; every query is run through a real
Prometheus in test_prometheus_scrape.py, which also sees each return data.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import pytest

from tests.deploy.support import (
    GRAFANA_SUBSTITUTIONS,
    consumer_metric_names,
    dashboard,
    dashboard_panels,
    dashboard_queries,
    queue_patterns,
    referenced_metrics,
    service_queues,
)
from topology.names import Names

# What the issue asks the dashboard to show, each by the metric that shows it.
REQUIRED = {
    "throughput by outcome": "consumer_messages_total",
    "lag": "consumer_event_lag_seconds_bucket",
    "retries by rung": "consumer_retries_published_total",
    "dead letters": "consumer_dead_letters_total",
    "in flight": "consumer_in_flight",
    "pool in use": "consumer_db_pool_in_use",
    "pool size": "consumer_db_pool_size",
    "paused": "consumer_paused",
    "broker connected": "consumer_broker_connected",
    "oldest receipt kept": "consumer_receipts_oldest_age_seconds",
    "receipts kept": "consumer_receipts_rows",
    "receipt partitions kept": "consumer_receipts_partitions",
    "unconfirmed publishes": "consumer_publish_failures_total",
    "lost settles": "consumer_settle_lost_total",
    "batch conflicts": "consumer_batch_conflicts_total",
    "pool saturation": "consumer_workers",
    "retry-queue depth": "rabbitmq_queue_messages",
    "delivery-limit dead letters": "rabbitmq_global_messages_dead_lettered_delivery_limit_total",
    "dead-letter queue depth": "rabbitmq_queue_messages",
    "held for dead-lettering (DeadLetteringStuck)": "rabbitmq_queue_messages_unacked",
}
# Shown from the process's own series, which referenced_metrics() does not pick out.
REQUIRED_PROCESS = ("process_start_time_seconds", "process_resident_memory_bytes")


def test_panels_have_unique_ids_a_place_and_the_datasource_variable() -> None:
    panels = dashboard_panels()
    ids = [panel["id"] for panel in panels]

    assert len(ids) == len(set(ids))
    for panel in panels:
        assert {"h", "w", "x", "y"} <= set(panel["gridPos"]), panel["title"]
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, panel["title"]
        for target in panel.get("targets", []):
            assert target["datasource"]["uid"] == "${datasource}", panel["title"]
            assert target["refId"]
    assert dashboard()["uid"] == "rabbit-pg-consumer"


def test_every_variable_used_is_defined_or_a_grafana_macro() -> None:
    defined = {variable["name"] for variable in dashboard()["templating"]["list"]}
    used = {
        name
        for query in dashboard_queries()
        for name in re.findall(r"\$(\w+)", query)
        if not name.startswith("__")
    }

    assert used <= defined
    assert {f"${name}" for name in used} <= set(GRAFANA_SUBSTITUTIONS)


def test_the_dashboard_shows_what_the_issue_asks_for() -> None:
    referenced = set().union(*(referenced_metrics(q) for q in dashboard_queries()))

    missing = {what: metric for what, metric in REQUIRED.items() if metric not in referenced}
    assert not missing


def test_every_consumer_metric_in_the_dashboard_is_exported() -> None:
    referenced = set().union(*(referenced_metrics(q) for q in dashboard_queries()))

    unknown = {
        name for name in referenced if name.startswith("consumer_")
    } - consumer_metric_names()
    assert not unknown


def test_the_dashboard_shows_restarts_and_the_process() -> None:
    queries = " ".join(dashboard_queries())

    assert [name for name in REQUIRED_PROCESS if name not in queries] == []


def test_queue_names_come_from_the_service_name_variable() -> None:
    queue_matchers = [
        matcher
        for query in dashboard_queries()
        for matcher in re.findall(r'queue=~?"([^"]*)"', query)
    ]

    # The broker's queue names come from $name; the consumer's own queue label (a queue table's
    # queue) is the $queue variable
    broker = [matcher for matcher in queue_matchers if matcher != "$queue"]
    assert broker
    assert all(matcher.startswith("$name") for matcher in broker), broker


def test_every_consumer_series_is_filtered_by_the_queue_variable() -> None:
    selectors = [
        selector
        for query in dashboard_queries()
        for selector in re.findall(r"(consumer_\w+)\{([^}]*)\}", query)
        if selector[0] not in ("consumer_build_info", "consumer_service_info")
    ]
    variable = {v["name"]: v for v in dashboard()["templating"]["list"]}["queue"]

    assert selectors
    assert [name for name, matchers in selectors if 'queue=~"$queue"' not in matchers] == []
    # All takes the series without the label too (no queue table)
    assert variable["includeAll"] is True
    assert variable["allValue"] == ".*"


@pytest.mark.parametrize("version", [1, 2, 10])
def test_the_work_queue_panel_shows_every_generation_and_no_other_queue(version: int) -> None:
    # Given the queues of a service's plan, and the panel's queries with its name in $name
    work, others = service_queues("billing.eu", version)
    (panel,) = [panel for panel in dashboard_panels() if panel["title"] == "Work queue"]
    patterns = [
        pattern.replace("$name", "billing.eu").replace("$queue", GRAFANA_SUBSTITUTIONS["$queue"])
        for target in panel["targets"]
        for pattern in queue_patterns(target["expr"])
    ]

    # Then each query takes the work queue, and none the dead-letter queue or a rung
    assert len(patterns) == len(panel["targets"])
    assert [pattern for pattern in patterns if not re.fullmatch(pattern, work)] == []
    assert [queue for queue in others for p in patterns if re.fullmatch(p, queue)] == []


# The broker panels (by the start of their title), and the kinds of a plan's queues each shows.
BROKER_PANELS = {
    "Work queue": ("work",),
    "Dead-letter queues": ("dead",),
    "Retry rungs": ("rung",),
    "Held for RabbitMQ's dead-lettering": ("work", "rung"),
}
TABLE = ("charges", "refunds", "invoices")
# The Queue variable as Grafana's Prometheus data source writes it into a regex matcher: All is its
# allValue; one value as it is; several as an alternation. None stands for the service's queues
# without a table (<name>.work ...), which only All shows.
SELECTIONS: dict[str, tuple[str, Sequence[str | None]]] = {
    "All": (GRAFANA_SUBSTITUTIONS["$queue"], (None, *TABLE)),
    "one queue": ("refunds", ("refunds",)),
    "two queues": ("(charges|refunds)", ("charges", "refunds")),
}


def _plan_by_kind(service: str, version: int, queue: str | None) -> dict[str, set[str]]:
    work, others = service_queues(service, version, queue)
    dead = Names(service, "events", work_version=version, queue=queue).dead
    return {"work": {work}, "dead": {dead}, "rung": set(others) - {dead}}


@pytest.mark.parametrize("selection", sorted(SELECTIONS))
@pytest.mark.parametrize("version", [1, 2])
def test_the_broker_panels_show_the_picked_queues_of_a_table_and_no_other(
    selection: str, version: int
) -> None:
    # Given a service's queues with a table of three queues, and those it had without one
    service = "billing.eu"
    plans = {queue: _plan_by_kind(service, version, queue) for queue in (None, *TABLE)}
    every_queue = {name for plan in plans.values() for names in plan.values() for name in names}
    value, picked = SELECTIONS[selection]
    panels = {
        prefix: [p for p in dashboard_panels() if p["title"].startswith(prefix)]
        for prefix in BROKER_PANELS
    }

    for prefix, kinds in BROKER_PANELS.items():
        (panel,) = panels[prefix]
        patterns = [
            pattern.replace("$name", service).replace("$queue", value)
            for target in panel["targets"]
            for pattern in queue_patterns(target["expr"])
        ]
        wanted = {name for queue in picked for kind in kinds for name in plans[queue][kind]}

        # Then each of its queries takes exactly the picked queues' queues of its kinds
        assert patterns, prefix
        for pattern in patterns:
            taken = {name for name in every_queue if re.fullmatch(pattern, name)}
            assert taken == wanted, (prefix, pattern, sorted(taken ^ wanted))
