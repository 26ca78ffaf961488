"""Helpers for the checks of deploy/: finding the tools, reading the files, a real Prometheus, and
a RabbitMQ node of a test's own with its Prometheus plugin on.

The tools come from the ``deploy`` extra (PyPI: hadolint, yamllint, docker-compose,
kubernetes-validate) and from Debian (promtool, prometheus, systemd-analyze; deploy/local/tools.sh).
A missing tool fails the check; it never skips it.
"""

from __future__ import annotations

import asyncio
import json
import re
import shutil
import subprocess
import sys
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from datetime import timedelta
from pathlib import Path, PurePosixPath
from typing import Any

import aiohttp
import pytest
import yaml

from tests.servers import ThrowawayRabbit, free_port
from tests.support import REPO, wait_until
from topology.names import Names
from topology.plan import TopologySpec, build_topology

DEPLOY = REPO / "deploy"
PROMETHEUS_DIR = DEPLOY / "prometheus"
DASHBOARD = DEPLOY / "grafana" / "rabbit-pg-consumer.json"
COMPOSE = DEPLOY / "compose.yaml"
COMPOSE_CLUSTER = DEPLOY / "compose.cluster.yaml"
"""compose.yaml's override with a three-node RabbitMQ cluster."""
K8S = DEPLOY / "k8s"
K8S_QUEUE_TABLE = K8S / "queue-table"
RUNBOOKS_BASE = "https://runbooks.example.com/consumer"
"""The base of every rule's runbook_url, which a deployer replaces (deploy/README.md)."""
SYSTEMD = DEPLOY / "systemd"

_METRIC_NAME = re.compile(r"\b((?:consumer|rabbitmq)_[a-z0-9_]+)\b")
_QUEUE_MATCHER = re.compile(r'\bqueue=~?"([^"]*)"')
# Grafana's macros and this dashboard's variables, replaced before Prometheus sees a query.
GRAFANA_SUBSTITUTIONS = {
    "$__rate_interval": "1m",
    "$__interval": "15s",
    "$__range": "1h",
    "$job": "consumer",
    "$instance": ".+",
    "$name": "consumer",
    "$queue": ".*",
}


def tool(name: str) -> str:
    """The path of a command-line tool: the virtualenv's own first, then ``PATH``."""
    beside_python = Path(sys.executable).parent / name
    if beside_python.exists():
        return str(beside_python)
    found = shutil.which(name)
    if found is None:
        pytest.fail(
            f"{name} is not installed; `make install tools` installs it "
            "(the deploy extra of pyproject.toml, or deploy/local/tools.sh)",
            pytrace=False,
        )
    return found


def run_tool(
    *argv: str, cwd: Path = REPO, timeout: float = 120
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [tool(argv[0]), *argv[1:]],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )


def assert_clean(result: subprocess.CompletedProcess[str]) -> None:
    """The tool exited 0 and wrote nothing to stderr (warnings count as failures)."""
    report = (
        f"{' '.join(str(part) for part in result.args)} exited {result.returncode}\n"
        f"{result.stdout}\n{result.stderr}"
    )
    assert result.returncode == 0, report
    assert not result.stderr.strip(), report


def yaml_documents(path: Path) -> list[dict[str, Any]]:
    documents = [doc for doc in yaml.safe_load_all(path.read_text()) if doc is not None]
    assert all(isinstance(doc, dict) for doc in documents), f"{path}: not a mapping"
    return documents


def yaml_file(path: Path) -> dict[str, Any]:
    (document,) = yaml_documents(path)
    return document


# -- the deploy paths' files, read as their tools read them -------------------------------------


def compose_model(*overrides: Path) -> dict[str, Any]:
    """compose.yaml (with ``overrides`` on top) as Compose itself normalises it
    (``docker-compose config``): anchors merged, variables interpolated with their defaults,
    paths absolute."""
    files = [argument for path in (COMPOSE, *overrides) for argument in ("-f", str(path))]
    result = run_tool("docker-compose", *files, "config", "--format", "json")
    assert result.returncode == 0, result.stderr
    model = json.loads(result.stdout)
    assert isinstance(model, dict)
    return model


def k8s_manifests() -> dict[Path, dict[str, Any]]:
    """Every manifest under k8s/ (one document per file), examples included; not the queue
    table's Component (k8s/queue-table), whose Deployments replace the base's one:
    tests/deploy/test_kubernetes_queue_table.py checks it."""
    found: dict[Path, dict[str, Any]] = {}
    for path in sorted(K8S.rglob("*.yaml")):
        if K8S_QUEUE_TABLE in path.parents:
            continue
        (document,) = yaml_documents(path)
        found[path] = document
    return found


def k8s_all(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in k8s_manifests().values() if doc["kind"] == kind]


def k8s_one(kind: str) -> dict[str, Any]:
    (document,) = k8s_all(kind)
    return document


def k8s_containers(pod: dict[str, Any]) -> list[dict[str, Any]]:
    return [*pod.get("initContainers", []), *pod["containers"]]


def k8s_secret_values(name: str) -> dict[str, str]:
    """The example Secret ``name``'s keys and values (secret.example.yaml and its likes)."""
    (secret,) = [doc for doc in k8s_all("Secret") if doc["metadata"]["name"] == name]
    values = secret["stringData"]
    assert isinstance(values, dict)
    return values


def k8s_secret_names(pod: dict[str, Any]) -> set[str]:
    """Every Secret a pod spec refers to: volumes (plain or projected), envFrom, env."""
    names = set()
    for volume in pod.get("volumes", []):
        if "secret" in volume:
            names.add(volume["secret"]["secretName"])
        for source in volume.get("projected", {}).get("sources", []):
            if "secret" in source:
                names.add(source["secret"]["name"])
    for container in k8s_containers(pod):
        for source in container.get("envFrom", []):
            if "secretRef" in source:
                names.add(source["secretRef"]["name"])
        for variable in container.get("env", []):
            reference = variable.get("valueFrom", {}).get("secretKeyRef")
            if reference is not None:
                names.add(reference["name"])
    return names


def _mounted_secret_file(pod: dict[str, Any], container: dict[str, Any], path: str) -> str:
    """The example value of the Secret key a container sees as the file ``path``."""
    wanted = PurePosixPath(path)
    volumes = {volume["name"]: volume for volume in pod.get("volumes", [])}
    for mount in container.get("volumeMounts", []):
        if wanted.parent != PurePosixPath(mount["mountPath"]):
            continue
        secret = volumes[mount["name"]]["secret"]
        items = {item["path"]: item["key"] for item in secret.get("items", [])}
        values = k8s_secret_values(secret["secretName"])
        key = items.get(wanted.name) if items else wanted.name
        assert key is not None, f"{container['name']}: {path} is not among the mounted items"
        return values[key]
    raise AssertionError(f"{container['name']}: nothing is mounted at {wanted.parent}")


def k8s_environment(pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
    """A container's CONSUMER_* settings as the service sees them: the ConfigMaps and Secrets it
    takes whole (envFrom), its env, and each ``*_FILE`` setting read from the example Secret
    mounted there (``CONSUMER_AMQP_URL_FILE`` becomes ``CONSUMER_AMQP_URL``)."""
    values: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            (config,) = [
                doc
                for doc in k8s_all("ConfigMap")
                if doc["metadata"]["name"] == source["configMapRef"]["name"]
            ]
            values.update(config["data"])
        else:
            values.update(k8s_secret_values(source["secretRef"]["name"]))
    for variable in container.get("env", []):
        name = variable["name"]
        if "valueFrom" in variable:
            reference = variable["valueFrom"]["secretKeyRef"]
            values[name] = k8s_secret_values(reference["name"])[reference["key"]]
        elif name.endswith("_URL_FILE"):
            values[name.removesuffix("_FILE")] = _mounted_secret_file(
                pod, container, variable["value"]
            )
        else:
            values[name] = variable["value"]
    return values


def unit_values(unit: str, key: str, section: str = "Service") -> list[str]:
    """Every value of ``key`` in a unit's ``section``, in order (systemd lets some repeat)."""
    values: list[str] = []
    current = None
    for raw in (SYSTEMD / unit).read_text().splitlines():
        line = raw.strip()
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
        elif current == section and line.startswith(f"{key}="):
            values.append(line.partition("=")[2])
    return values


def env_file(installed: str) -> dict[str, str]:
    """The example of an installed environment file (/etc/consumer/X.env is systemd/X.env.example),
    as systemd reads it: KEY=VALUE lines, comments and blank lines skipped."""
    path = SYSTEMD / f"{PurePosixPath(installed).name}.example"
    values: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.lstrip().startswith("#"):
            key, _, value = line.partition("=")
            values[key.strip()] = value.strip()
    return values


def unit_environment(unit: str) -> dict[str, str]:
    """The settings a unit starts with: its EnvironmentFile= files in order, later ones winning."""
    values: dict[str, str] = {}
    for installed in unit_values(unit, "EnvironmentFile"):
        values.update(env_file(installed))
    return values


def settings_fields(values: Mapping[str, str]) -> dict[str, str]:
    """CONSUMER_* variables as the Settings model's field names (the rest left out)."""
    return {
        key.removeprefix("CONSUMER_").lower(): value
        for key, value in values.items()
        if key.startswith("CONSUMER_")
    }


def referenced_metrics(expression: str) -> set[str]:
    """``consumer_*`` and ``rabbitmq_*`` metric names in a PromQL expression."""
    return set(_METRIC_NAME.findall(expression))


def exposed_names(exposition: str) -> set[str]:
    """Every series name a Prometheus text exposition can yield, samples or not."""
    names: set[str] = set()
    for line in exposition.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(maxsplit=3)
            if kind in ("histogram", "summary"):
                names.update({f"{name}_count", f"{name}_sum", f"{name}_created"})
                if kind == "histogram":
                    names.add(f"{name}_bucket")
            else:
                names.add(name)
        elif line and not line.startswith("#"):
            names.add(re.split(r"[{ ]", line, maxsplit=1)[0])
    return names


def promql_string(literal: str) -> str:
    """The value of a PromQL string literal's body: a doubled backslash is one."""
    return literal.replace("\\\\", "\\")


def queue_patterns(expression: str) -> list[str]:
    """The values of a PromQL expression's ``queue`` matchers, as Prometheus reads them."""
    return [promql_string(value) for value in _QUEUE_MATCHER.findall(expression)]


def service_queues(
    service: str, work_version: int, queue: str | None = None
) -> tuple[str, list[str]]:
    """The work queue of a service's plan at one ``CONSUMER_WORK_QUEUE_VERSION`` (of one ``queue``
    of its queue table), and its other queues (the dead-letter queue and every rung), as
    ``consumer topology apply`` declares them."""
    names = Names(service, "events", work_version=work_version, queue=queue)
    ladder = [timedelta(milliseconds=ms) for ms in (500, 5_000, 120_000, 3_600_000)]
    plan = build_topology(TopologySpec(names, ladder, delivery_limit=20, event_types=["a.b"]))
    queues = [queue.name for queue in plan.queues]
    assert names.work in queues
    return names.work, [name for name in queues if name != names.work]


def alert_rules() -> list[dict[str, Any]]:
    return [
        rule
        for group in yaml_file(PROMETHEUS_DIR / "alerts.yml")["groups"]
        for rule in group["rules"]
    ]


def dashboard() -> dict[str, Any]:
    loaded = json.loads(DASHBOARD.read_text())
    assert isinstance(loaded, dict)
    return loaded


def dashboard_panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    for panel in dashboard()["panels"]:
        panels.append(panel)
        panels.extend(panel.get("panels", []))
    return panels


def dashboard_queries() -> list[str]:
    return [
        target["expr"]
        for panel in dashboard_panels()
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def as_promql(grafana_query: str) -> str:
    for macro, value in GRAFANA_SUBSTITUTIONS.items():
        grafana_query = grafana_query.replace(macro, value)
    assert "$" not in grafana_query, f"a Grafana variable is left in {grafana_query!r}"
    return grafana_query


class PrometheusServer:
    """The ``prometheus`` binary on a free port with its own storage, for one test."""

    def __init__(self, config: dict[str, Any], workdir: Path) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.config_path = workdir / "prometheus.yml"
        self.config_path.write_text(yaml.safe_dump(config, sort_keys=False))
        self.log_path = workdir / "prometheus.log"
        self.process: subprocess.Popen[bytes] | None = None
        self.url = f"http://127.0.0.1:{self.port}"

    def start(self) -> PrometheusServer:
        log = self.log_path.open("wb")
        self.process = subprocess.Popen(
            [
                tool("prometheus"),
                f"--config.file={self.config_path}",
                f"--storage.tsdb.path={self.workdir / 'data'}",
                f"--web.listen-address=127.0.0.1:{self.port}",
                "--log.level=warn",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        log.close()
        return self

    def stop(self) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(timeout=5)

    def log_text(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    async def get(self, path: str, **params: str) -> Any:
        async with (
            aiohttp.ClientSession() as session,
            session.get(
                f"{self.url}{path}", params=params, timeout=aiohttp.ClientTimeout(10)
            ) as response,
        ):
            body = await response.json()
        assert body.get("status") == "success", f"{path} {params}: {body}"
        return body["data"]

    async def wait_ready(self, timeout: float = 30) -> None:
        async def ready() -> bool:
            assert self.process is not None
            if self.process.poll() is not None:
                raise AssertionError(f"prometheus exited:\n{self.log_text()[-3000:]}")
            try:
                async with (
                    aiohttp.ClientSession() as session,
                    session.get(f"{self.url}/-/ready") as response,
                ):
                    return response.status == 200
            except aiohttp.ClientError:
                return False

        await wait_until(ready, timeout=timeout, what="Prometheus to be ready")

    async def query(self, expression: str) -> list[dict[str, Any]]:
        data = await self.get("/api/v1/query", query=expression)
        result = data["result"]
        assert isinstance(result, list)
        return result

    async def value(self, expression: str) -> float | None:
        """The single value ``expression`` returns now, or None when it returns nothing."""
        result = await self.query(expression)
        if not result:
            return None
        assert len(result) == 1, f"{expression}: {result}"
        return float(result[0]["value"][1])


@contextmanager
def prometheus_server(config: dict[str, Any], workdir: Path) -> Iterator[PrometheusServer]:
    server = PrometheusServer(config, workdir).start()
    try:
        yield server
    finally:
        server.stop()


class RabbitWithPrometheus(ThrowawayRabbit):
    """A RabbitMQ node of the test's own, its plugins from deploy/rabbitmq/enabled_plugins and
    rabbitmq_prometheus (and management) listening on free ports."""

    def __init__(self) -> None:
        super().__init__()
        self.prometheus_port = free_port()
        self.management_port = free_port()

    def prepare(self) -> None:
        for sub in ("mnesia", "log"):
            (self.base / sub).mkdir(parents=True)
        shutil.copy(DEPLOY / "rabbitmq" / "enabled_plugins", self.base / "enabled_plugins")
        (self.base / "rabbitmq.conf").write_text(
            f"prometheus.tcp.ip = 127.0.0.1\nprometheus.tcp.port = {self.prometheus_port}\n"
            f"management.tcp.ip = 127.0.0.1\nmanagement.tcp.port = {self.management_port}\n"
            # Queue metrics every second instead of every 5s: the test waits for them.
            "collect_statistics_interval = 1000\n"
        )
        (self.base / "rabbitmq-env.conf").write_text("")
        for path in [self.base, *self.base.rglob("*")]:
            shutil.chown(path, "rabbitmq", "rabbitmq")

    async def start_async(self) -> None:
        self.prepare()
        await asyncio.to_thread(self.start)

    async def destroy_async(self) -> None:
        await asyncio.to_thread(self.destroy)


def consumer_metric_names() -> set[str]:
    """Every series name the service can export (from consumer/observe/metrics.py, no process
    needed)."""
    from prometheus_client import CollectorRegistry, generate_latest

    from consumer.observe.metrics import Metrics

    metrics = Metrics(CollectorRegistry(), ["example.type"])
    return exposed_names(generate_latest(metrics.registry).decode())
