"""deploy/k8s/queue-table (a kustomize Component) and deploy/k8s-queue-table (the overlay taking
the base and it): one Deployment per queue of examples/queues.toml, each running
``consumer run --queues <queue>`` with the table from a ConfigMap, and a KEDA ScaledObject per
queue on that queue's work queue.

The files are checked as they are; the overlay's build (``kubectl kustomize``, offline) is checked
where kubectl is installed, its built-in kinds against the Kubernetes schemas in strict mode.
"""

from __future__ import annotations

import shutil
import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from consumer.config.settings import Settings
from consumer.service.components import names_for
from tests.deploy.support import (
    DEPLOY,
    K8S_QUEUE_TABLE,
    k8s_environment,
    k8s_one,
    run_tool,
    settings_fields,
    yaml_file,
)
from tests.support import REPO

OVERLAY = DEPLOY / "k8s-queue-table"
TABLE = REPO / "examples" / "queues.toml"
TABLE_PATH = "/etc/consumer/queues.toml"
QUEUE_LABEL = "rabbit-pg-consumer/queue"
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# PostgreSQL's default max_connections (100) less superuser_reserved_connections (3).
POSTGRES_CONNECTION_BUDGET = 97


def _queues() -> dict[str, dict[str, Any]]:
    queues = tomllib.loads(TABLE.read_text())["queues"]
    assert isinstance(queues, dict)
    return queues


def _part(kind: str, queue: str) -> dict[str, Any]:
    prefix = {"Deployment": "deployment", "ScaledObject": "scaledobject"}.get(kind, kind.lower())
    document = yaml_file(K8S_QUEUE_TABLE / f"{prefix}-{queue}.yaml")
    assert document["kind"] == kind
    return document


def _base_settings() -> Settings:
    pod = k8s_one("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    return Settings.model_validate(settings_fields(k8s_environment(pod, container)))


def test_the_components_table_is_the_examples() -> None:
    assert (K8S_QUEUE_TABLE / "queues.toml").read_text() == TABLE.read_text()
    assert len(_queues()) >= 2


def test_the_component_lists_every_file_of_its_folder() -> None:
    component = yaml_file(K8S_QUEUE_TABLE / "kustomization.yaml")
    listed = set(component["resources"]) | {patch["path"] for patch in component["patches"]}
    here = {p.name for p in K8S_QUEUE_TABLE.glob("*.yaml")} - {"kustomization.yaml"}

    assert component["kind"] == "Component"
    assert listed == here
    ((generator,)) = component["configMapGenerator"]
    assert generator == {**generator, "name": "consumer-queues", "files": ["queues.toml"]}
    resources = {
        f"{kind}-{queue}.yaml"
        for kind in ("deployment", "scaledobject", "poddisruptionbudget")
        for queue in _queues()
    }
    assert resources <= set(component["resources"])


@pytest.mark.parametrize("queue", sorted(_queues()))
def test_each_queue_runs_alone_with_the_table(queue: str) -> None:
    deployment = _part("Deployment", queue)
    pod = deployment["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    env = {item["name"]: item["value"] for item in container["env"]}
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}

    assert deployment["metadata"]["name"] == f"consumer-{queue}"
    assert container["args"] == ["consumer", "run", "--queues", queue]
    assert env["CONSUMER_QUEUES_FILE"] == TABLE_PATH
    (volume,) = [name for name, path in mounts.items() if TABLE_PATH.startswith(path + "/")]
    assert volumes[volume]["configMap"]["name"] == "consumer-queues"
    # Its own pods only: the selectors of the other queues' Deployments and budgets miss them
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    assert labels[QUEUE_LABEL] == queue
    assert deployment["spec"]["selector"]["matchLabels"].items() <= labels.items()
    for other in set(_queues()) - {queue}:
        selector = _part("Deployment", other)["spec"]["selector"]["matchLabels"]
        assert not selector.items() <= labels.items()
        selector = _part("PodDisruptionBudget", other)["spec"]["selector"]["matchLabels"]
        assert not selector.items() <= labels.items()
    budget = _part("PodDisruptionBudget", queue)["spec"]["selector"]["matchLabels"]
    assert budget.items() <= labels.items()
    # The base's Service and NetworkPolicy select every queue's pods
    assert k8s_one("Service")["spec"]["selector"].items() <= labels.items()


@pytest.mark.parametrize("queue", sorted(_queues()))
def test_keda_scales_each_queue_on_its_own_work_queue(queue: str) -> None:
    scaled = _part("ScaledObject", queue)
    auth = yaml_file(K8S_QUEUE_TABLE / "triggerauthentication.yaml")
    settings = _base_settings()
    version = _queues()[queue].get("work_queue_version", settings.work_queue_version)
    settings = settings.model_copy(update={"work_queue_version": version})

    assert scaled["spec"]["scaleTargetRef"]["name"] == f"consumer-{queue}"
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "rabbitmq"
    assert trigger["metadata"]["mode"] == "QueueLength"
    assert trigger["metadata"]["queueName"] == names_for(settings, queue).work
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    assert 1 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_the_largest_scale_of_every_queue_fits_postgres_default_connection_budget() -> None:
    settings = _base_settings()
    setup_job = 1
    total = setup_job
    for queue, row in _queues().items():
        replicas = _part("ScaledObject", queue)["spec"]["maxReplicaCount"]
        liveness_lock = 1
        total += replicas * (row.get("db_pool_size", settings.db_pool_size) + liveness_lock)

    assert total <= POSTGRES_CONNECTION_BUDGET


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_components_built_in_kinds_validate(version: str) -> None:
    paths = [
        str(K8S_QUEUE_TABLE / f"{kind}-{queue}.yaml")
        for kind in ("deployment", "poddisruptionbudget")
        for queue in _queues()
    ]

    result = run_tool("kubernetes-validate", "--strict", "--quiet", "-k", version, *paths)

    assert result.returncode == 0, result.stdout + result.stderr
    assert not result.stdout.strip(), result.stdout


# -- the overlay's build, where kubectl is installed ---------------------------------------------


def _build() -> list[dict[str, Any]]:
    kubectl = shutil.which("kubectl")
    if kubectl is None:
        pytest.skip("kubectl is not installed: the overlay's build is not checked")
    result = subprocess.run(
        [kubectl, "kustomize", str(OVERLAY)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stderr
    return [doc for doc in yaml.safe_load_all(result.stdout) if doc]


def test_the_overlay_builds_one_deployment_per_queue_and_nothing_else_runs_them_all() -> None:
    built = _build()
    by_kind: dict[str, list[dict[str, Any]]] = {}
    for document in built:
        by_kind.setdefault(document["kind"], []).append(document)
    (table,) = [c for c in by_kind["ConfigMap"] if c["metadata"]["name"] != "consumer"]
    (settings,) = [c for c in by_kind["ConfigMap"] if c["metadata"]["name"] == "consumer"]

    names = {f"consumer-{queue}" for queue in _queues()}
    assert {d["metadata"]["name"] for d in by_kind["Deployment"]} == names
    assert {d["metadata"]["name"] for d in by_kind["ScaledObject"]} == names
    assert {d["metadata"]["name"] for d in by_kind["PodDisruptionBudget"]} == names
    assert all(
        d["metadata"].get("namespace") == "consumer" for d in built if d["kind"] != "Namespace"
    )
    assert table["data"] == {"queues.toml": TABLE.read_text()}
    assert "CONSUMER_HANDLERS" in settings["data"]
    # The generated name (its hash) reaches every pod that reads the table, the setup Job's too
    readers = [*by_kind["Deployment"], *by_kind["Job"]]
    for workload in readers:
        volumes = workload["spec"]["template"]["spec"]["volumes"]
        assert table["metadata"]["name"] in {v.get("configMap", {}).get("name") for v in volumes}
    (job,) = by_kind["Job"]
    (topology,) = job["spec"]["template"]["spec"]["containers"]
    assert {"name": "CONSUMER_QUEUES_FILE", "value": TABLE_PATH} in topology["env"]


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_the_overlays_built_in_kinds_validate(version: str, tmp_path: Path) -> None:
    custom = {"ScaledObject", "TriggerAuthentication"}
    paths = []
    for number, document in enumerate(_build()):
        if document["kind"] in custom:
            continue
        path = tmp_path / f"{number}-{document['kind']}.yaml"
        path.write_text(yaml.safe_dump(document))
        paths.append(str(path))

    result = run_tool("kubernetes-validate", "--strict", "--quiet", "-k", version, *paths)

    assert result.returncode == 0, result.stdout + result.stderr
    assert not result.stdout.strip(), result.stdout
