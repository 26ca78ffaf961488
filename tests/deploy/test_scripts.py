"""deploy/local's shell scripts pass shellcheck."""

from __future__ import annotations

import urllib.request

import pytest

from tests.deploy.support import DEPLOY, assert_clean, run_tool

# services.sh keeps one informational note (SC2012, `ls` to pick the newest cluster version).
SEVERITY = {"tools.sh": "style", "services.sh": "warning", "pin-base-image.sh": "style"}


@pytest.mark.parametrize("script", sorted(p.name for p in (DEPLOY / "local").glob("*.sh")))
def test_shellcheck_passes(script: str) -> None:
    result = run_tool(
        "shellcheck", f"--severity={SEVERITY[script]}", str(DEPLOY / "local" / script)
    )

    assert_clean(result)
    assert not result.stdout.strip(), result.stdout


def test_the_local_set_up_gives_the_broker_its_prometheus_endpoint() -> None:
    # Given the local services (started, or already up: the script is a no-op then)
    result = run_tool("bash", str(DEPLOY / "local" / "services.sh"))
    assert result.returncode == 0, result.stdout + result.stderr

    # When RabbitMQ's Prometheus endpoint is asked for its per-queue series
    with urllib.request.urlopen("http://127.0.0.1:15692/metrics/per-object", timeout=30) as reply:
        exposition = reply.read().decode()

    # Then it answers with the families the queue rules and panels read (a queue's series
    # exist while the queue does)
    assert "# TYPE rabbitmq_queue_messages gauge" in exposition
    assert "rabbitmq_global_messages_dead_lettered_delivery_limit_total{" in exposition
