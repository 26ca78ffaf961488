"""deploy/k8s.

Built-in kinds (Namespace, ConfigMap, Secret, Deployment, Job, Service, PodDisruptionBudget,
NetworkPolicy) are
validated offline by kubernetes-validate against the Kubernetes OpenAPI schemas it ships, in
strict mode (an unknown field fails). The Operator and KEDA kinds (ServiceMonitor, PrometheusRule,
ScaledObject, TriggerAuthentication) and the Kustomizations have no schema there: they are parsed
and their required fields and cross-references checked below, which is weaker than a schema check.
No cluster, kubectl or kustomize runs here.
"""

from __future__ import annotations

from typing import Any
from urllib.parse import urlsplit

import pytest

from consumer.config.settings import Settings, split_urls
from consumer.durations import parse_duration
from consumer.service.components import names_for
from tests.deploy.support import (
    K8S,
    alert_rules,
    k8s_all,
    k8s_containers,
    k8s_environment,
    k8s_manifests,
    k8s_one,
    k8s_secret_values,
    run_tool,
    settings_fields,
    yaml_file,
)

BUILT_IN = {
    "v1": {"Namespace", "ConfigMap", "Secret", "Service"},
    "apps/v1": {"Deployment"},
    "batch/v1": {"Job"},
    "policy/v1": {"PodDisruptionBudget"},
    "networking.k8s.io/v1": {"NetworkPolicy"},
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


def _is(document: dict[str, Any], kinds: dict[str, set[str]]) -> bool:
    return document.get("kind") in kinds.get(document.get("apiVersion", ""), set())


def _pod_specs() -> list[dict[str, Any]]:
    return [k8s_one(kind)["spec"]["template"]["spec"] for kind in ("Deployment", "Job")]


def _settings() -> Settings:
    """The consumer container's settings (the ConfigMap, its env, the example Secret's URLs
    through the mounted files), through the service's own settings parser."""
    pod = k8s_one("Deployment")["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    fields = settings_fields(k8s_environment(pod, container))
    assert set(fields) <= set(Settings.model_fields), sorted(fields)
    return Settings.model_validate(fields)


def test_every_manifest_is_a_kind_these_checks_know() -> None:
    for path, document in k8s_manifests().items():
        assert _is(document, BUILT_IN) or _is(document, CUSTOM), f"{path}: {document.get('kind')}"


@pytest.mark.parametrize("version", KUBERNETES_VERSIONS)
def test_built_in_kinds_validate_against_the_kubernetes_schemas(version: str) -> None:
    paths = [str(p) for p, doc in k8s_manifests().items() if _is(doc, BUILT_IN)]

    result = run_tool("kubernetes-validate", "--strict", "--quiet", "-k", version, *paths)

    assert result.returncode == 0, result.stdout + result.stderr
    assert not result.stdout.strip(), result.stdout
    assert len(paths) == 10


def test_each_kustomization_lists_its_foldersk8s_manifests() -> None:
    for path, document in k8s_manifests().items():
        if document["kind"] != "Kustomization":
            continue
        listed = {path.parent / resource for resource in document["resources"]}
        here = {p for p in path.parent.glob("*.yaml") if p.name != "kustomization.yaml"}
        assert all(p.exists() for p in listed), f"{path}: {listed - here}"
        examples = {p for p in here if p.name.endswith(".example.yaml")}
        assert here - listed == examples, f"{path}: {here - listed}"
        assert document["namespace"] == "consumer"


def test_the_image_name_matches_the_kustomization() -> None:
    (image,) = yaml_file(K8S / "kustomization.yaml")["images"]

    for pod in _pod_specs():
        assert {c["image"] for c in k8s_containers(pod)} == {image["name"]}


def test_pods_run_unprivileged_with_limits_on_a_read_only_root() -> None:
    for pod in _pod_specs():
        assert pod["securityContext"]["runAsNonRoot"] is True
        assert pod["securityContext"]["runAsUser"] != 0
        assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"
        assert pod["automountServiceAccountToken"] is False
        for container in k8s_containers(pod):
            security = container["securityContext"]
            assert security["readOnlyRootFilesystem"] is True
            assert security["allowPrivilegeEscalation"] is False
            assert security["capabilities"]["drop"] == ["ALL"]
            assert {"cpu", "memory"} <= set(container["resources"]["requests"])
            assert {"cpu", "memory"} <= set(container["resources"]["limits"])
            # Settings from the ConfigMap; credentials as files, never the whole Secret as env
            assert [list(source) for source in container["envFrom"]] == [["configMapRef"]]


def test_the_deployment_probes_health_and_readiness_and_outlasts_the_grace() -> None:
    pod = k8s_one("Deployment")["spec"]["template"]["spec"]
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
    pod = k8s_one("Job")["spec"]["template"]["spec"]

    assert [c["args"] for c in pod["initContainers"]] == [["consumer", "migrate"]]
    assert [c["args"] for c in pod["containers"]] == [["consumer", "topology", "apply"]]
    assert pod["restartPolicy"] == "Never"


def test_service_and_budget_select_the_consumer_pods_only() -> None:
    deployment = k8s_one("Deployment")
    pod_labels = deployment["spec"]["template"]["metadata"]["labels"]
    job_labels = k8s_one("Job")["spec"]["template"]["metadata"]["labels"]
    service = k8s_one("Service")
    budget = k8s_one("PodDisruptionBudget")

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
    monitor = k8s_one("ServiceMonitor")
    service = k8s_one("Service")

    assert (
        monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    )
    (endpoint,) = monitor["spec"]["endpoints"]
    assert endpoint["port"] in {port["name"] for port in service["spec"]["ports"]}
    assert endpoint["path"] == "/metrics"
    # The Operator names the job after the Service; the rules select on that job.
    assert service["metadata"]["name"] == "consumer"
    assert any('job="consumer"' in rule["expr"] for rule in alert_rules())
    assert k8s_one("PrometheusRule")["metadata"]["labels"] == monitor["metadata"]["labels"]


def test_keda_scales_the_deployment_on_the_work_queue_depth() -> None:
    scaled = k8s_one("ScaledObject")
    auth = k8s_one("TriggerAuthentication")

    assert scaled["spec"]["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "name": k8s_one("Deployment")["metadata"]["name"],
    }
    (trigger,) = scaled["spec"]["triggers"]
    assert trigger["type"] == "rabbitmq"
    assert trigger["metadata"]["mode"] == "QueueLength"
    settings = _settings()
    # The queue the replicas consume: a CONSUMER_WORK_QUEUE_VERSION raised in the ConfigMap
    # (`consumer topology migrate`) without the ScaledObject following fails here
    assert trigger["metadata"]["queueName"] == names_for(settings).work
    assert int(trigger["metadata"]["value"]) > 0
    assert trigger["authenticationRef"]["name"] == auth["metadata"]["name"]
    (reference,) = auth["spec"]["secretTargetRef"]
    # One address: the scaler's host takes no list of nodes
    assert reference == {"parameter": "host", "name": "consumer", "key": "keda-amqp-url"}
    host = k8s_secret_values(reference["name"])[reference["key"]]
    assert host.startswith("amqp://")
    assert "," not in host
    assert 2 <= scaled["spec"]["minReplicaCount"] <= scaled["spec"]["maxReplicaCount"]


def test_the_largest_scale_fits_postgres_default_connection_budget() -> None:
    replicas = k8s_one("ScaledObject")["spec"]["maxReplicaCount"]
    setup_job = 1

    assert replicas * _settings().db_pool_size + setup_job <= POSTGRES_CONNECTION_BUDGET


# -- NetworkPolicy -------------------------------------------------------------------------------

# Where the example Secrets and monitoring/ put the peers (networkpolicy.yaml's header).
PROMETHEUS_NAMESPACE = "monitoring"
PROMETHEUS_POD = {"app.kubernetes.io/name": "prometheus"}
DNS_NAMESPACE = "kube-system"
DNS_POD = {"k8s-app": "kube-dns"}
BROKER_PORTS = {("TCP", 5672), ("TCP", 5671)}  # amqp:// and amqps://
DATABASE_PORTS = {("TCP", 5432)}
DNS_PORTS = {("UDP", 53), ("TCP", 53)}


def _pod_labels(kind: str) -> dict[str, str]:
    labels = k8s_one(kind)["spec"]["template"]["metadata"]["labels"]
    assert isinstance(labels, dict)
    return labels


def _policy_for(kind: str) -> dict[str, Any]:
    """The one NetworkPolicy whose podSelector selects the pods of the Deployment or the Job."""
    labels = _pod_labels(kind)
    (policy,) = [
        policy
        for policy in k8s_all("NetworkPolicy")
        if policy["spec"]["podSelector"]["matchLabels"].items() <= labels.items()
    ]
    return policy


def _ports(rule: dict[str, Any]) -> set[tuple[str, int]]:
    return {(port.get("protocol", "TCP"), port["port"]) for port in rule["ports"]}


def _namespace(peer: dict[str, Any]) -> str:
    selector = peer["namespaceSelector"]
    assert set(selector) == {"matchLabels"}, selector
    (name,) = selector["matchLabels"].values()
    assert selector["matchLabels"] == {"kubernetes.io/metadata.name": name}
    return str(name)


def _egress(policy: dict[str, Any]) -> dict[str, set[tuple[str, int]]]:
    """Each egress peer's namespace and the ports opened to it; every rule names its peers."""
    opened: dict[str, set[tuple[str, int]]] = {}
    for rule in policy["spec"]["egress"]:
        assert rule.get("to"), f"{policy['metadata']['name']}: egress to anywhere: {rule}"
        assert rule.get("ports"), f"{policy['metadata']['name']}: egress on any port: {rule}"
        for peer in rule["to"]:
            assert "ipBlock" not in peer, peer
            opened.setdefault(_namespace(peer), set()).update(_ports(rule))
            if "podSelector" in peer:
                assert _namespace(peer) == DNS_NAMESPACE
                assert peer["podSelector"] == {"matchLabels": DNS_POD}
    return opened


def _example_servers() -> dict[str, tuple[str, int]]:
    """``scheme -> (namespace, port)`` of every server the example Secrets' URLs name."""
    servers: dict[str, tuple[str, int]] = {}
    for secret in k8s_all("Secret"):
        for value in secret["stringData"].values():
            for scheme, host, port in _nodes(value):
                # host.namespace.svc, or pod.service.namespace.svc for a cluster's nodes
                labels = host.split(".")
                servers[scheme] = (labels[labels.index("svc") - 1], port)
    return servers


def _nodes(value: str) -> list[tuple[str, str, int]]:
    """``(scheme, host, port)`` of every server a URL names: a comma-separated list of amqp://
    URLs, or a postgresql:// URL with several ``host:port`` (each port given)."""
    urls = split_urls(value) if value.startswith("amqp") else [value]
    found = []
    for text in urls:
        url = urlsplit(text)
        for address in url.netloc.rpartition("@")[2].split(","):
            host, _, port = address.rpartition(":")
            assert host, text
            assert port.isdigit(), text
            found.append((url.scheme, host, int(port)))
    return found


def test_the_example_secrets_name_three_broker_nodes_and_a_primary_with_its_standby() -> None:
    for name in ("consumer", "consumer-setup"):
        values = k8s_secret_values(name)
        brokers = {host for _, host, _ in _nodes(values["amqp-url"])}
        databases = {host for _, host, _ in _nodes(values["database-url"])}
        assert len(brokers) == 3, name
        assert len(databases) == 2, name
        # The service's own parser takes both (a several-host DSN must ask for the primary)
        settings = Settings.model_validate(
            {"amqp_url": values["amqp-url"], "database_url": values["database-url"]}
        )
        assert "target_session_attrs=read-write" in settings.database_url.get_secret_value()


def test_one_network_policy_isolates_each_workload_both_ways() -> None:
    consumer = _policy_for("Deployment")
    setup = _policy_for("Job")

    assert consumer is not setup
    assert len(k8s_all("NetworkPolicy")) == 2
    for policy in (consumer, setup):
        assert sorted(policy["spec"]["policyTypes"]) == ["Egress", "Ingress"]
        assert set(policy["spec"]["podSelector"]) == {"matchLabels"}
    # Each selects its own pods only: the consumer's policy not the Job's, and the other way
    selector = consumer["spec"]["podSelector"]["matchLabels"]
    assert not selector.items() <= _pod_labels("Job").items()
    selector = setup["spec"]["podSelector"]["matchLabels"]
    assert not selector.items() <= _pod_labels("Deployment").items()


def test_the_consumers_accept_only_prometheus_and_only_on_the_http_port() -> None:
    (container,) = k8s_one("Deployment")["spec"]["template"]["spec"]["containers"]
    http = {port["name"]: port["containerPort"] for port in container["ports"]}["http"]

    (rule,) = _policy_for("Deployment")["spec"]["ingress"]

    assert _ports(rule) == {("TCP", http)}
    assert http == _settings().http_port
    # The port the ServiceMonitor scrapes (through the Service's targetPort)
    (service_port,) = k8s_one("Service")["spec"]["ports"]
    (endpoint,) = k8s_one("ServiceMonitor")["spec"]["endpoints"]
    assert endpoint["port"] == service_port["name"]
    assert service_port["targetPort"] == "http"
    # from Prometheus's pods in its namespace: one peer with both selectors (two would be "or")
    (peer,) = rule["from"]
    assert set(peer) == {"namespaceSelector", "podSelector"}
    assert _namespace(peer) == PROMETHEUS_NAMESPACE
    assert peer["podSelector"] == {"matchLabels": PROMETHEUS_POD}


def test_the_setup_job_accepts_nothing() -> None:
    assert _policy_for("Job")["spec"]["ingress"] == []


def test_both_reach_only_rabbitmq_postgresql_and_dns() -> None:
    servers = _example_servers()
    broker_namespace, broker_port = servers["amqp"]
    database_namespace, database_port = servers["postgresql"]

    for kind in ("Deployment", "Job"):
        opened = _egress(_policy_for(kind))

        assert opened == {
            broker_namespace: BROKER_PORTS,
            database_namespace: DATABASE_PORTS,
            DNS_NAMESPACE: DNS_PORTS,
        }, kind
        # the example URLs' servers are among them
        assert ("TCP", broker_port) in opened[broker_namespace]
        assert ("TCP", database_port) in opened[database_namespace]
