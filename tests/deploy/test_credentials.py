"""Who logs in as whom, in every deploy path: compose, the systemd units, Kubernetes.

The least privilege deploy/README.md documents ("Security"): `consumer run` logs in as the
RabbitMQ user <name> and the PostgreSQL role consumer_app; `consumer migrate` as consumer_migrate,
with no broker URL; `consumer topology apply` as <name>-bootstrap, with no database URL; none of
them as the database superuser or the broker's administrator. Read from the files themselves:
compose's normalised model, each unit's EnvironmentFile= lines and their example files, the
manifests with their example Secrets, each workload's URLs resolved as the service resolves them
(``*_FILE`` settings through the mounted Secret). tests/security proves these accounts are enough
(test_least_privilege) and runs the scripts that make them (test_deploy_scripts).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import pytest

from consumer.config.settings import Settings
from tests.deploy.support import (
    compose_model,
    env_file,
    k8s_all,
    k8s_environment,
    k8s_one,
    k8s_secret_names,
    k8s_secret_values,
    unit_environment,
    unit_values,
)

# users.sh names the users after CONSUMER_NAME, which every deploy path leaves at its default.
NAME = Settings.model_fields["name"].default
POSTGRES_SUPERUSER = "postgres"  # the postgres image's, and every cluster's, unless renamed


@dataclass(frozen=True, slots=True)
class Logins:
    """The user in each URL a workload is given (None: it is given no such URL)."""

    amqp: str | None
    database: str | None


EXPECTED = {
    "run": Logins(amqp=NAME, database="consumer_app"),
    "migrate": Logins(amqp=None, database="consumer_migrate"),
    "topology": Logins(amqp=f"{NAME}-bootstrap", database=None),
}


def _logins(values: Mapping[str, str]) -> Logins:
    def user(key: str) -> str | None:
        assert f"{key}_FILE" not in values, f"{key}_FILE was not resolved"
        return urlsplit(values[key]).username if key in values else None

    return Logins(amqp=user("CONSUMER_AMQP_URL"), database=user("CONSUMER_DATABASE_URL"))


def _password(url: str) -> str:
    password = urlsplit(url).password
    assert password, url
    return password


def _workload(command: list[str]) -> str:
    assert command[0] == "consumer", command
    return command[1]


# -- compose -------------------------------------------------------------------------------------


def _compose_workloads() -> dict[str, dict[str, Any]]:
    """The services that run the consumer image, by the command they run."""
    return {
        _workload(service["command"]): service
        for service in compose_model()["services"].values()
        if (service.get("command") or [""])[0] == "consumer"
    }


def test_compose_gives_each_workload_only_its_own_logins() -> None:
    workloads = _compose_workloads()

    assert {name: _logins(service["environment"]) for name, service in workloads.items()} == (
        EXPECTED
    )


def test_compose_never_runs_a_workload_as_the_superuser_or_the_broker_administrator() -> None:
    services = compose_model()["services"]
    administrator = services["rabbitmq"]["environment"]["RABBITMQ_DEFAULT_USER"]
    superuser = services["postgres"]["environment"].get("POSTGRES_USER", POSTGRES_SUPERUSER)
    administrative_passwords = {
        services["rabbitmq"]["environment"]["RABBITMQ_DEFAULT_PASS"],
        services["postgres"]["environment"]["POSTGRES_PASSWORD"],
    }

    for name, service in _compose_workloads().items():
        logins = _logins(service["environment"])
        assert administrator not in (logins.amqp, superuser), name
        assert superuser != logins.database, name
        for key, value in service["environment"].items():
            assert not key.startswith(("RABBITMQ_", "POSTGRES_", "PG")), (name, key)
            assert not any(secret in value for secret in administrative_passwords), (name, key)
    # and the administrator and the superuser are not the service's own accounts
    assert administrator not in {login.amqp for login in EXPECTED.values()}
    assert superuser not in {login.database for login in EXPECTED.values()}


def test_compose_makes_each_account_with_the_password_its_workload_logs_in_with() -> None:
    services = compose_model()["services"]
    workloads = _compose_workloads()
    users = services["rabbitmq-users"]["environment"]
    roles = services["postgres-roles"]["environment"]

    # users.sh makes consumer and consumer-bootstrap (no CONSUMER_NAME: the default)
    assert "CONSUMER_NAME" not in users
    assert users["RABBITMQ_CONSUMER_PASSWORD"] == _password(
        workloads["run"]["environment"]["CONSUMER_AMQP_URL"]
    )
    assert users["RABBITMQ_BOOTSTRAP_PASSWORD"] == _password(
        workloads["topology"]["environment"]["CONSUMER_AMQP_URL"]
    )
    # roles.sql makes consumer_app and consumer_migrate, as the superuser
    assert roles["POSTGRES_APP_PASSWORD"] == _password(
        workloads["run"]["environment"]["CONSUMER_DATABASE_URL"]
    )
    assert roles["POSTGRES_MIGRATE_PASSWORD"] == _password(
        workloads["migrate"]["environment"]["CONSUMER_DATABASE_URL"]
    )
    assert roles["PGUSER"] == POSTGRES_SUPERUSER
    assert roles["PGPASSWORD"] == services["postgres"]["environment"]["POSTGRES_PASSWORD"]
    # Four accounts, four passwords, none the superuser's
    passwords = {
        users["RABBITMQ_CONSUMER_PASSWORD"],
        users["RABBITMQ_BOOTSTRAP_PASSWORD"],
        roles["POSTGRES_APP_PASSWORD"],
        roles["POSTGRES_MIGRATE_PASSWORD"],
    }
    assert len(passwords) == 4
    assert roles["PGPASSWORD"] not in passwords


# -- systemd -------------------------------------------------------------------------------------

UNITS = {
    "run": "consumer.service",
    "migrate": "consumer-migrate.service",
    "topology": "consumer-topology.service",
}
SHARED = "/etc/consumer/common.env"


@pytest.mark.parametrize("workload", sorted(UNITS))
def test_systemd_gives_each_unit_only_its_own_logins(workload: str) -> None:
    unit = UNITS[workload]

    assert _logins(unit_environment(unit)) == EXPECTED[workload]
    assert unit_values(unit, "ExecStart")[0].split()[1] == workload


def test_systemd_each_unit_reads_a_credentials_file_no_other_unit_reads() -> None:
    files = {workload: unit_values(unit, "EnvironmentFile") for workload, unit in UNITS.items()}

    own = {
        workload: [path for path in paths if path != SHARED] for workload, paths in files.items()
    }
    assert all(paths[0] == SHARED for paths in files.values()), files
    assert all(len(paths) == 1 for paths in own.values()), own
    assert len({paths[0] for paths in own.values()}) == len(UNITS)
    # The shared file carries settings, no credentials
    assert not [key for key in env_file(SHARED) if key.endswith(("_URL", "_URL_FILE"))]


# -- Kubernetes ----------------------------------------------------------------------------------


def _k8s_workloads() -> dict[str, tuple[dict[str, Any], dict[str, Any]]]:
    """``workload -> (pod spec, container)`` for every container running the image."""
    found = {}
    for kind in ("Deployment", "Job"):
        pod = k8s_one(kind)["spec"]["template"]["spec"]
        for container in [*pod.get("initContainers", []), *pod["containers"]]:
            found[_workload(container["args"])] = (pod, container)
    return found


@pytest.mark.parametrize("workload", sorted(EXPECTED))
def test_kubernetes_gives_each_container_only_its_own_logins(workload: str) -> None:
    pod, container = _k8s_workloads()[workload]

    assert _logins(k8s_environment(pod, container)) == EXPECTED[workload]


def test_kubernetes_each_secret_is_read_by_its_own_workload_only() -> None:
    deployment = k8s_one("Deployment")["spec"]["template"]["spec"]
    job = k8s_one("Job")["spec"]["template"]["spec"]
    (reference,) = k8s_one("TriggerAuthentication")["spec"]["secretTargetRef"]

    assert k8s_secret_names(deployment) == {"consumer"}
    assert k8s_secret_names(job) == {"consumer-setup"}
    assert {secret["metadata"]["name"] for secret in k8s_all("Secret")} == {
        "consumer",
        "consumer-setup",
    }
    # Each Secret holds only its workload's URLs
    for secret, workloads in (("consumer", ["run"]), ("consumer-setup", ["migrate", "topology"])):
        values = {
            f"CONSUMER_{key.upper().replace('-', '_')}": value
            for key, value in k8s_secret_values(secret).items()
        }
        held = _logins(values)
        assert held.amqp in {EXPECTED[w].amqp for w in workloads}, secret
        assert held.database in {EXPECTED[w].database for w in workloads}, secret
    # KEDA counts the work queue as the consumer's user, with the consumers' Secret
    assert reference["name"] == "consumer"
    assert urlsplit(k8s_secret_values("consumer")[reference["key"]]).username == NAME
