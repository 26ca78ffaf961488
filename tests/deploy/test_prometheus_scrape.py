"""A real Prometheus, configured from deploy/prometheus/prometheus.yml, scrapes a running consumer
and a RabbitMQ node that has deploy/rabbitmq/enabled_plugins; its HTTP API then answers for the
alert rules and every dashboard query.

The config is used as written except: 1s intervals, the rule file's absolute path, and
static_configs instead of the service discovery (compose's DNS names do not exist here).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path
from typing import Any

import aio_pika
import aiohttp

from consumer.registry import HandlerRegistry
from consumer.service.components import topology_for
from tests.deploy.support import (
    PROMETHEUS_DIR,
    PrometheusServer,
    RabbitWithPrometheus,
    alert_rules,
    as_promql,
    dashboard_queries,
    prometheus_server,
    referenced_metrics,
    tool,
    yaml_file,
)
from tests.support import Producer, ServiceProcess, TestEnv, behave, fetchval, wait_until
from topology.apply import apply_topology
from topology.model import Topology

WAITING_ON_THE_NODE = 7
_BROKER_DELIVERY_LIMIT = "rabbitmq_global_messages_dead_lettered_delivery_limit_total"
# A metric selector in a rule: a name, and its matchers if it has any.
_SELECTOR = re.compile(r"\b(?:consumer|rabbitmq|process)_[a-z0-9_]+(?:\{[^}]*\})?")


def _config(consumer_target: str, rabbitmq_target: str) -> dict[str, Any]:
    config = yaml_file(PROMETHEUS_DIR / "prometheus.yml")
    config["global"].update(scrape_interval="1s", scrape_timeout="1s", evaluation_interval="1s")
    config["rule_files"] = [str(PROMETHEUS_DIR / name) for name in config["rule_files"]]
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"consumer", "rabbitmq"}
    for name, target in (("consumer", consumer_target), ("rabbitmq", rabbitmq_target)):
        job = jobs[name]
        for key in [key for key in job if key.endswith("_sd_configs") or key == "static_configs"]:
            del job[key]
        job["static_configs"] = [{"targets": [target]}]
    return config


async def _fill_work_queue_on(rabbit: RabbitWithPrometheus, env: TestEnv) -> None:
    """The service's topology under its default name (queue consumer.work), and events in it
    that nobody consumes."""
    # The default names on a node of the test's own: no other test or service is on it.
    settings = env.settings(amqp_url=rabbit.url, name="consumer", exchange="events")
    topology = topology_for(settings, HandlerRegistry.from_modules(settings.handlers))
    await _apply_on(rabbit, topology)
    async with Producer(rabbit.url, settings.exchange) as producer:
        for n in range(WAITING_ON_THE_NODE):
            await producer.send("test.behave", behave(f"waiting-{n}"))


async def _apply_on(rabbit: RabbitWithPrometheus, topology: Topology) -> None:
    connection = await aio_pika.connect(rabbit.url)
    try:
        await apply_topology(connection, topology)
    finally:
        await connection.close()


async def _declare_on(rabbit: RabbitWithPrometheus, queue: str) -> None:
    """An empty quorum queue: the next work queue generation, as a migration declares it."""
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        await channel.declare_queue(queue, durable=True, arguments={"x-queue-type": "quorum"})
    finally:
        await connection.close()


async def _dead_letter_at_the_delivery_limit(rabbit: RabbitWithPrometheus) -> None:
    """What a crash loop does, on a queue of its own: a delivery returned past its quorum
    queue's delivery limit, which the broker then dead-letters (reason delivery_limit)."""
    connection = await aio_pika.connect(rabbit.url)
    try:
        channel = await connection.channel()
        queue = await channel.declare_queue(
            "probe.delivery-limit",
            durable=True,
            arguments={"x-queue-type": "quorum", "x-delivery-limit": 1},
        )
        await channel.default_exchange.publish(aio_pika.Message(b"{}"), routing_key=queue.name)
        for _ in range(5):
            message = await queue.get(fail=False)
            if message is None:
                return
            await message.nack(requeue=True)
        raise AssertionError("the broker never dead-lettered the probe at its delivery limit")
    finally:
        await connection.close()


async def _rules_evaluated(prometheus: PrometheusServer) -> list[dict[str, Any]]:
    data = await prometheus.get("/api/v1/rules")
    return [rule for group in data["groups"] for rule in group["rules"]]


async def test_prometheus_scrapes_the_consumer_and_rabbitmq_and_evaluates_rules_and_dashboard(
    env: TestEnv, tmp_path: Path
) -> None:
    # Given a consumer running on a RabbitMQ node with the deploy's plugins, and Prometheus
    rabbit = RabbitWithPrometheus()
    service = ServiceProcess(env, amqp_url=rabbit.url)
    try:
        await rabbit.start_async()
        await _apply_on(rabbit, env.topology())
        await service.start().wait_ready()
        await _fill_work_queue_on(rabbit, env)
        await _declare_on(rabbit, env.names.work_queue(2))
        config = _config(f"127.0.0.1:{service.port}", f"127.0.0.1:{rabbit.prometheus_port}")
        (tmp_path / "prometheus").mkdir()
        with prometheus_server(config, tmp_path / "prometheus") as prometheus:
            await prometheus.wait_ready()

            # When events are applied, one retried once and one dead-lettered, and the broker
            # dead-letters a delivery at its delivery limit
            # (once Prometheus holds the broker's counter at 0: increase() needs a first sample)
            async def counter_scraped() -> bool:
                return bool(await prometheus.query(_BROKER_DELIVERY_LIMIT))

            await wait_until(counter_scraped, timeout=20, what="the broker's counter at 0")
            await _dead_letter_at_the_delivery_limit(rabbit)
            async with env.producer(rabbit.url) as producer:
                for n in range(20):
                    await producer.send("test.behave", behave(f"k{n}"))
                await producer.send("test.behave", behave("retried", fail_transient=1))
                await producer.send("test.behave", behave("dead", permanent=True))

            async def applied() -> bool:
                return (
                    int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) == 21
                )

            await wait_until(applied, what="21 effects")

            # Then both targets are up, and the counter Prometheus stored rose with the events
            async def scraped() -> bool:
                processed = await prometheus.value(
                    'sum(consumer_messages_total{job="consumer", outcome="processed"})'
                )
                return processed is not None and processed >= 21

            await wait_until(scraped, timeout=20, what="Prometheus to see 21 processed")

            async def both_up() -> bool:
                up = await prometheus.query("up")
                return {(r["metric"]["job"], r["value"][1]) for r in up} == {
                    ("consumer", "1"),
                    ("rabbitmq", "1"),
                }

            await wait_until(both_up, timeout=20, what="both targets to be up")
            targets = (await prometheus.get("/api/v1/targets"))["activeTargets"]
            paths = {t["labels"]["job"]: t["scrapeUrl"].split("/", 3)[3] for t in targets}
            assert paths == {"consumer": "metrics", "rabbitmq": "metrics/per-object"}

            # And every alert rule evaluates without error on the real series
            async def rules_evaluated() -> bool:
                return all(r["health"] != "unknown" for r in await _rules_evaluated(prometheus))

            await wait_until(rules_evaluated, timeout=20, what="the rules to be evaluated")
            rules = await _rules_evaluated(prometheus)
            assert {r["name"] for r in rules} == {r["alert"] for r in alert_rules()}
            assert [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"] == []

            # And the work-queue rule's selector finds the queue's depth in RabbitMQ's metrics
            (growing,) = [r for r in alert_rules() if r["alert"] == "WorkQueueGrowing"]
            selector = re.search(r"rabbitmq_queue_messages_ready\{[^}]*\}", growing["expr"])
            assert selector is not None

            async def depth_seen() -> bool:
                found = await prometheus.query(f"max by (vhost, queue) ({selector.group(0)})")
                depths = {r["metric"]["queue"]: float(r["value"][1]) for r in found}
                return depths.get("consumer.work") == WAITING_ON_THE_NODE

            await wait_until(depth_seen, timeout=30, what="the work queue's depth in Prometheus")

            # And every series an alert rule selects is one Prometheus has data for, the
            # service's queues found from its name (RetryQueueStuck, DeadLetter*, WorkQueueGrowing)
            selectors = {
                match.group(0)
                for rule in alert_rules()
                for match in _SELECTOR.finditer(rule["expr"])
                # The branch for a queue table's queues (`<name>.<queue>.*`): the service here
                # runs without a table, so its series carry no queue label (the rules' own
                # promtool cases in deploy/prometheus/alerts.test.yml cover that branch).
                if 'queue!=""' not in match.group(0)
            }
            assert any(s.startswith("rabbitmq_") for s in selectors)
            assert any(s.startswith("process_") for s in selectors)

            async def all_selected() -> bool:
                return all([await prometheus.query(f"count({s})") for s in selectors])

            try:
                await wait_until(all_selected, timeout=20, what="every rule's series")
            except AssertionError:
                empty = [s for s in selectors if not await prometheus.query(f"count({s})")]
                raise AssertionError(f"rule selectors with no data: {empty}") from None

            # And the work-queue rule's join (its selector, the service's name read from the
            # queue's) keeps the running service's work queue of both generations, as a
            # migration leaves them for a while, and drops consumer.work, whose service no
            # replica runs
            (to_name,) = re.findall(r'"name", "\$1", "queue", "[^"]*"', growing["expr"])
            work_queues = await prometheus.query(
                f"label_replace(max by (queue) ({selector.group(0)}), {to_name})"
                " and on (name) group by (name) (last_over_time(consumer_service_info[1d]))"
            )
            assert sorted(r["metric"]["queue"] for r in work_queues) == [
                env.names.work_queue(1),
                env.names.work_queue(2),
            ]

            # And the dead-letter rules see the service's dead letter in its own dead-letter
            # queue, and the broker's rule the delivery-limit one (the rules without their `for`)
            rule_exprs = {r["alert"]: r["expr"] for r in alert_rules()}

            async def dead_letter_seen() -> bool:
                found = await prometheus.query(rule_exprs["DeadLetterQueueNotEmpty"])
                return [(r["metric"]["queue"], r["value"][1]) for r in found] == [
                    (f"{env.name}.dead", "1")
                ]

            await wait_until(dead_letter_seen, timeout=30, what="DeadLetterQueueNotEmpty's series")

            async def delivery_limit_seen() -> bool:
                found = await prometheus.query(rule_exprs["BrokerDeliveryLimitDeadLetters"])
                return [r["metric"]["job"] for r in found] == ["rabbitmq"]

            await wait_until(delivery_limit_seen, timeout=30, what="the delivery-limit dead letter")

            # And every dashboard query parses and returns data
            queries = [as_promql(query) for query in dashboard_queries()]

            async def all_answer() -> bool:
                return all([await prometheus.query(query) for query in queries])

            try:
                await wait_until(all_answer, timeout=20, what="every dashboard query to answer")
            except AssertionError:
                empty = [q for q in queries if not await prometheus.query(q)]
                raise AssertionError(f"dashboard queries with no data: {empty}") from None

            # And every metric the rules and the dashboard read is one Prometheus has
            names = set(await prometheus.get("/api/v1/label/__name__/values"))
            read = {
                name
                for expression in [*queries, *(r["expr"] for r in alert_rules())]
                for name in referenced_metrics(expression)
            }
            assert read - names == set()
    finally:
        await service.stop()
        await rabbit.destroy_async()


async def test_promtool_accepts_the_services_exposition(env: TestEnv) -> None:
    # Given a running service that has applied an event
    await env.apply_topology()
    service = await ServiceProcess(env).start().wait_ready()
    async with env.producer() as producer:
        await producer.send("test.behave", behave("one"))

    async def applied() -> bool:
        return int(await fetchval(env.database_url, "SELECT count(*) FROM test_effects")) == 1

    await wait_until(applied, what="the effect")

    # When its /metrics is linted
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"http://127.0.0.1:{service.port}/metrics") as response,
    ):
        exposition = await response.text()
    result = subprocess.run(
        [tool("promtool"), "check", "metrics"],
        input=exposition,
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    await service.stop()

    # Then promtool finds nothing to say
    assert result.returncode == 0, result.stdout + result.stderr
    assert not (result.stdout + result.stderr).strip()
    assert "consumer_messages_total" in exposition
    # And it carries the process's own series, and no _created series beside the counters
    assert "process_start_time_seconds" in exposition
    assert "_created" not in exposition
    assert f'consumer_service_info{{name="{env.name}"}} 1.0' in exposition
