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

# A dot in CONSUMER_NAME too; generation 1 is <name>.work, n is <name>.work.v<n>.
_SERVICES = ("consumer", "billing.eu")
_WORK_QUEUE_VERSIONS = (1, 2, 10)


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


@pytest.mark.parametrize("version", _WORK_QUEUE_VERSIONS)
@pytest.mark.parametrize("service", _SERVICES)
def test_the_work_queue_rule_takes_every_generation_and_no_other_queue(
    service: str, version: int
) -> None:
    # Given the queues of a service's plan, its work queue of one generation among them
    work, others = service_queues(service, version)
    (rule,) = [rule for rule in alert_rules() if rule["alert"] == "WorkQueueGrowing"]
    patterns = queue_patterns(rule["expr"])
    (to_name,) = re.findall(r'"name", "\$1", "queue", "([^"]*)"', rule["expr"])

    # Then every selector of the rule takes the work queue, and the join reads the service from it
    assert patterns
    assert [pattern for pattern in patterns if not re.fullmatch(pattern, work)] == []
    named = re.fullmatch(promql_string(to_name), work)
    assert named is not None
    assert named.group(1) == service
    # And none takes the service's dead-letter queue or a rung
    assert [queue for queue in others for p in patterns if re.fullmatch(p, queue)] == []


@pytest.mark.parametrize("version", _WORK_QUEUE_VERSIONS)
def test_no_other_queue_rule_takes_a_work_queue(version: int) -> None:
    work, _ = service_queues("consumer", version)

    taken = [
        rule["alert"]
        for rule in alert_rules()
        if rule["alert"] != "WorkQueueGrowing"
        for pattern in queue_patterns(rule["expr"])
        if re.fullmatch(pattern, work)
    ]

    assert taken == []
