"""deploy/prometheus: the config and the alert rules pass promtool, and every rule has unit tests
that see it fire and stay quiet."""

from __future__ import annotations

import re
from typing import Any

import pytest

from tests.deploy.support import (
    DEPLOY,
    PROMETHEUS_DIR,
    RUNBOOKS_BASE,
    alert_rules,
    assert_clean,
    consumer_metric_names,
    promql_string,
    queue_patterns,
    referenced_metrics,
    run_tool,
    service_queues,
    yaml_file,
)
from tests.servers import restart_member_expression
from topology.names import Names

# A dot in CONSUMER_NAME too; generation 1 is <name>.work, n is <name>.work.v<n>.
_SERVICES = ("consumer", "billing.eu")
_WORK_QUEUE_VERSIONS = (1, 2, 10)
# Its depth, and what it holds for its at-least-once dead-letter worker (as the rungs do).
_WATCH_THE_WORK_QUEUE = {"WorkQueueGrowing", "DeadLetteringStuck"}
_PLANS = [Names(s, "events", work_version=v) for s in _SERVICES for v in _WORK_QUEUE_VERSIONS]


def test_promtool_checks_the_config_and_the_rule_files_it_names() -> None:
    result = run_tool("promtool", "check", "config", "prometheus.yml", cwd=PROMETHEUS_DIR)

    assert_clean(result)
    assert "alerts.yml" in result.stdout


def test_promtool_checks_the_rules() -> None:
    result = run_tool("promtool", "check", "rules", "alerts.yml", cwd=PROMETHEUS_DIR)

    assert_clean(result)
    assert f"SUCCESS: {len(alert_rules())} rules found" in result.stdout


def test_promtool_unit_tests_pass() -> None:
    result = run_tool("promtool", "test", "rules", "alerts.test.yml", cwd=PROMETHEUS_DIR)

    assert_clean(result)
    assert "SUCCESS" in result.stdout


@pytest.mark.parametrize("rule", [rule["alert"] for rule in alert_rules()])
def test_every_rule_is_tested_firing_and_quiet(rule: str) -> None:
    cases = [
        case
        for test in yaml_file(PROMETHEUS_DIR / "alerts.test.yml")["tests"]
        for case in test.get("alert_rule_test", [])
        if case["alertname"] == rule
    ]

    assert any(case.get("exp_alerts") for case in cases), f"no test sees {rule} fire"
    assert any(not case.get("exp_alerts") for case in cases), f"no test sees {rule} stay quiet"


def test_every_alert_carries_a_severity_and_a_summary() -> None:
    for rule in alert_rules():
        assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
        assert rule["annotations"]["summary"], rule["alert"]
        assert rule["annotations"]["description"], rule["alert"]


@pytest.mark.parametrize("rule", alert_rules(), ids=lambda rule: rule["alert"])
def test_every_alert_links_its_runbook_and_the_runbook_exists(rule: dict[str, Any]) -> None:
    url = rule["annotations"]["runbook_url"]

    assert url == f"{RUNBOOKS_BASE}/{rule['alert']}.md"
    runbook = (DEPLOY / "runbooks" / f"{rule['alert']}.md").read_text()
    assert runbook.startswith(f"# {rule['alert']}\n")
    for section in ("## What it means", "## What to look at", "## What to do"):
        assert section in runbook, f"{rule['alert']}: no {section!r}"


def test_every_runbook_is_an_alerts() -> None:
    pages = {path.stem for path in (DEPLOY / "runbooks").glob("*.md")} - {"README"}

    assert pages == {rule["alert"] for rule in alert_rules()}


def test_every_runbooks_dead_letter_step_gives_a_queue_tables_form_too() -> None:
    pages = {path.stem: path.read_text() for path in (DEPLOY / "runbooks").glob("*.md")}
    readme = pages.pop("README")

    # A page that sends the operator to `consumer dlq` also gives `consumer dlq --queue <queue>`
    sends = [name for name, text in pages.items() if "`consumer dlq " in text]
    assert sends
    assert [name for name in sends if "`consumer dlq --queue <queue> " not in pages[name]] == []
    # and the README says how an alert names a table's queue, on each kind of series
    (section,) = re.findall(r"^## With a queue table\n(.*?)(?=^## |\Z)", readme, re.M | re.S)
    assert '`queue="refunds"`' in section  # the service's series: the table's queue
    assert "`consumer.refunds.dead`" in section  # RabbitMQ's: the broker's queue
    assert "`consumer dlq --queue refunds list`" in section


def test_the_operators_prometheusrule_holds_the_same_rules() -> None:
    rule = yaml_file(DEPLOY / "k8s" / "monitoring" / "prometheusrule.yaml")

    assert rule["spec"]["groups"] == yaml_file(PROMETHEUS_DIR / "alerts.yml")["groups"], (
        "deploy/k8s/monitoring/prometheusrule.yaml differs from deploy/prometheus/alerts.yml"
    )


def test_every_consumer_metric_in_the_rules_is_exported() -> None:
    referenced = set().union(*(referenced_metrics(rule["expr"]) for rule in alert_rules()))

    unknown = {
        name for name in referenced if name.startswith("consumer_")
    } - consumer_metric_names()
    assert not unknown


def _queue_rule(alert: str) -> tuple[list[str], str]:
    """A queue rule's ``queue`` patterns, and the pattern its join reads the service's name with
    (group 1), as Prometheus reads them."""
    (rule,) = [rule for rule in alert_rules() if rule["alert"] == alert]
    (to_name,) = re.findall(r'"name", "\$1", "queue", "([^"]*)"', rule["expr"])
    return queue_patterns(rule["expr"]), promql_string(to_name)


def _assert_watched(queue: str, service: str, patterns: list[str], to_name: str) -> None:
    """Every pattern takes ``queue``, and the join reads ``service`` from its name."""
    assert patterns
    assert [pattern for pattern in patterns if not re.fullmatch(pattern, queue)] == [], queue
    named = re.fullmatch(to_name, queue)
    assert named is not None, queue
    assert named.group(1) == service, queue


@pytest.mark.parametrize("version", _WORK_QUEUE_VERSIONS)
@pytest.mark.parametrize("service", _SERVICES)
def test_the_work_queue_rule_takes_every_generation_and_no_other_queue(
    service: str, version: int
) -> None:
    # Given the queues of a service's plan, its work queue of one generation among them
    work, others = service_queues(service, version)
    patterns, to_name = _queue_rule("WorkQueueGrowing")

    # Then every selector of the rule takes the work queue, and the join reads the service from it
    _assert_watched(work, service, patterns, to_name)
    # And none takes the service's dead-letter queue or a rung
    assert [queue for queue in others for p in patterns if re.fullmatch(p, queue)] == []


@pytest.mark.parametrize("version", _WORK_QUEUE_VERSIONS)
def test_no_other_queue_rule_takes_a_work_queue(version: int) -> None:
    work, _ = service_queues("consumer", version)

    taken = [
        rule["alert"]
        for rule in alert_rules()
        if rule["alert"] not in _WATCH_THE_WORK_QUEUE
        for pattern in queue_patterns(rule["expr"])
        if re.fullmatch(pattern, work)
    ]

    assert taken == []


@pytest.mark.parametrize("names", _PLANS, ids=lambda names: names.work)
def test_the_stuck_dead_lettering_rule_takes_the_work_queue_and_the_rungs_never_the_dead_queue(
    names: Names,
) -> None:
    # Given a service's plan: the queues that dead-letter at-least-once, and its dead-letter queue
    service, dead = names.service, names.dead
    work, others = service_queues(service, names.work_version)
    dead_lettering = [work, *(queue for queue in others if queue != dead)]
    patterns, to_name = _queue_rule("DeadLetteringStuck")

    # Then every selector takes each of them, and the join reads the service from its name
    for queue in dead_lettering:
        _assert_watched(queue, service, patterns, to_name)
    # And none takes the dead-letter queue, which dead-letters nothing
    assert [pattern for pattern in patterns if re.fullmatch(pattern, dead)] == []


def test_the_stuck_dead_lettering_runbook_gives_the_step_the_chaos_runner_applies() -> None:
    runbook = (DEPLOY / "runbooks" / "DeadLetteringStuck.md").read_text()

    # The runbook's shell form: its variables in place of the names, its quotes escaped
    step = restart_member_expression("$QUEUE", "$VHOST").replace('"', '\\"')

    assert step in " ".join(runbook.split())


@pytest.mark.parametrize("service", _SERVICES)
def test_the_work_queue_rules_take_a_queue_tables_work_queue_as_service_dot_queue(
    service: str,
) -> None:
    # Given a queue table's queue: its work queue <name>.<queue>.work, its dead-letter queue
    names = Names(service, "events", queue="charges")

    # Then the rules watching the work queue take it, and read <name>.<queue> from it: the name
    # the join builds from consumer_service_info's name and queue labels
    for alert in _WATCH_THE_WORK_QUEUE:
        patterns, to_name = _queue_rule(alert)
        _assert_watched(names.work, f"{service}.charges", patterns, to_name)
        assert [pattern for pattern in patterns if re.fullmatch(pattern, names.dead)] == []
