"""deploy/k8s.

Built-in kinds (Namespace, ConfigMap, Secret, Deployment, Job, Service, PodDisruptionBudget) are
validated offline by kubernetes-validate against the Kubernetes OpenAPI schemas it ships, in
strict mode (an unknown field fails). The Operator and KEDA kinds (ServiceMonitor, PrometheusRule,
ScaledObject, TriggerAuthentication) and the Kustomizations have no schema there: they are parsed
and their required fields and cross-references checked below, which is weaker than a schema check.
No cluster, kubectl or kustomize runs here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from consumer.durations import parse_duration
from consumer.settings import Settings
from tests.deploy.support import DEPLOY, alert_rules, run_tool, yaml_documents, yaml_file
from topology.names import Names

K8S = DEPLOY / "k8s"
BUILT_IN = {
    "v1": {"Namespace", "ConfigMap", "Secret", "Service"},
    "apps/v1": {"Deployment"},
    "batch/v1": {"Job"},
    "policy/v1": {"PodDisruptionBudget"},
}
CUSTOM = {
    "monitoring.coreos.com/v1": {"ServiceMonitor", "PrometheusRule"},
    "keda.sh/v1alpha1": {"ScaledObject", "TriggerAuthentication"},
    "kustomize.config.k8s.io/v1beta1": {"Kustomization"},
}
# The oldest Kubernetes this is meant for, and the newest whose schemas the tool ships.
KUBERNETES_VERSIONS = ("1.30.0", "1.37.0")
# PostgreSQL's default max_connections (100) less superuser_reserved_connections (3).
POSTGRES_CONNECTION_BUDGET = 97


def _manifests() -> dict[Path, dict[str, Any]]:
    found: dict[Path, dict[str, Any]] = {}
    for path in sorted(K8S.rglob("*.yaml")):
        (document,) = yaml_documents(path)
        found[path] = document
    return found


def _is(document: dict[str, Any], kinds: dict[str, set[str]]) -> bool:
    return document.get("kind") in kinds.get(document.get("apiVersion", ""), set())


def _one(kind: str) -> dict[str, Any]:
    (document,) = [doc for doc in _manifests().values() if doc["kind"] == kind]
    return document


def _pod_specs() -> list[dict[str, Any]]:
    return [_one(kind)["spec"]["template"]["spec"] for kind in ("Deployment", "Job")]


def _containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def _settings() -> Settings:
    """The ConfigMap plus the example Secret, through the service's own settings parser."""
    values = {**_one("ConfigMap")["data"], **_one("Secret")["stringData"]}
    fields = {key.removeprefix("CONSUMER_").lower(): value for key, value in values.items()}
    assert set(fields) <= set(Settings.model_fields), sorted(fields)
    return Settings.model_validate(fields)


def test_every_manifest_is_a_kind_these_checks_know() -> None:
    for path, document in _manifests().items():
        assert _is(document, BUILT_IN) or _is(document, CUSTOM), f"{path}: {document.get('kind')}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_kinds_validate_against_the_kubernetes_schemas(version: str) -> None:
    paths = [str(p) for p, doc in _manifests().items() if _is(doc, BUILT_IN)]

    result = run_tool("kubernetes-validate", "--strict", "--quiet", "-k", version, *paths)

    assert result.returncode == 0, result.stdout + result.stderr
    assert not result.stdout.strip(), result.stdout
    assert len(paths) == 7


def test_each_kustomization_lists_its_folders_manifests() -> None:
    for path, document in _manifests().items():
        if document["kind"] != "Kustomization":
            continue
        listed = {path.parent / resource for resource in document["resources"]}
        here = {p for p in path.parent.glob("*.yaml") if p.name != "kustomization.yaml"}
        assert all(p.exists() for p in listed), f"{path}: {listed - here}"
        assert here - listed == {K8S / "secret.example.yaml"} & here, f"{path}: {here - listed}"
        assert document["namespace"] == "consumer"


def test_the_image_name_matches_the_kustomization() -> None:
    (image,) = yaml_file(K8S / "kustomization.yaml")["images"]

    for pod in _pod_specs():
        assert {c["image"] for c in _containers(pod)} == {image["name"]}


def test_pods_run_unprivileged_with_limits_on_a_read_only_root() -> None:
    for pod in _pod_specs():
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for container in _containers(pod):
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert {"cpu", "memory"} <= set(container["resources"]["limits"])
            assert {"configMapRef", "secretRef"} == {
                key for source in container["envFrom"] for key in source
            }


def test_the_deployment_probes_health_and_readiness_and_outlasts_the_grace() -> None:
    pod = _one("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    ports = {port["name"]: port["containerPort"] for port in container["ports"]}

    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["port"] in ports
    assert ports["http"] == _settings().http_port
    assert container["args"] == ["consumer", "run"]
    grace = parse_duration(pod["terminationGracePeriodSeconds"])
    assert grace > _settings().shutdown_grace
    assert _settings().http_host == "0.0.0.0"


def test_the_setup_job_migrates_then_declares_the_topology() -> None:
    pod = _one("Job")["spec"]["template"]["spec"]

    assert [c["args"] for c in pod["initContainers"]] == [["consumer", "migrate"]]
    assert [c["args"] for c in pod["containers"]] == [["consumer", "topology", "apply"]]
    assert pod["restartPolicy"] == "Never"


def test_service_and_budget_select_the_consumer_pods_only() -> None:
    deployment = _one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    job_labels = _one("Job")["spec"]["template"]["metadata"]["labels"]
    service = _one("Service")
    budget = _one("PodDisruptionBudget")

    for selector in (
        service["spec"]["selector"],
        budget["spec"]["selector"]["matchLabels"],
        deployment["spec"]["selector"]["matchLabels"],
    ):
        assert selector.items() <= pod_labels.items()
        assert not selector.items() <= job_labels.items()
    assert service["spec"]["ports"][0]["targetPort"] == "http"
    assert budget["spec"]["maxUnavailable"] < deployment["spec"]["replicas"]


def test_the_service_monitor_scrapes_the_service_as_job_consumer() -> None:
    monitor = _one("ServiceMonitor")
    service = _one("Service")

    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # The Operator names the job after the Service; the rules select on that job.
    assert service["metadata"]["name"] == "consumer"
    assert any('job="consumer"' in rule["expr"] for rule in alert_rules())
    assert _one("PrometheusRule")["metadata"]["labels"] == monitor["metadata"]["labels"]


def test_keda_scales_the_deployment_on_the_work_queue_depth() -> None:
    scaled = _one("ScaledObject")
    auth = _one("TriggerAuthentication")
    secret = _one("Secret")

    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": _one("Deployment")["metadata"]["name"],
    }
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "rabbitmq"
    assert trigger["metadata"]["mode"] == "QueueLength"
    settings = _settings()
    assert trigger["metadata"]["queueName"] == Names(settings.name, settings.exchange).work
    assert int(trigger["metadata"]["value"]) > 0
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (reference,) = auth["spec"]["secretTargetRef"]
    assert reference == {"parameter": "host", "name": "consumer", "key": "CONSUMER_AMQP_URL"}
    assert reference["key"] in secret["stringData"]
    assert 2 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_the_largest_scale_fits_postgres_default_connection_budget() -> None:
    replicas = _one("ScaledObject")["spec"]["maxReplicaCount"]
    setup_job = 1

    assert replicas * _settings().db_pool_size + setup_job <= POSTGRES_CONNECTION_BUDGET
