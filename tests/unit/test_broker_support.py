"""A queue's own delivery acknowledgement timeout: the plan sets ``x-consumer-timeout`` on the
work queue alone, and a broker older than RabbitMQ 3.12 (which ignores it) is refused in one line
saying what to do instead."""

from __future__ import annotations

from datetime import timedelta

import pytest

from topology.broker_support import CONSUMER_TIMEOUT, broker_version, unsupported
from topology.model import Topology
from topology.names import Names
from topology.plan import TopologySpec, build_topology


def plan(ack_timeout: timedelta | None, queue: str | None = "report") -> Topology:
    return build_topology(
        TopologySpec(
            names=Names(service="svc", ingress="events", queue=queue),
            retry_delays=(timedelta(seconds=5),),
            delivery_limit=5,
            event_types=("report.build",),
            ack_timeout=ack_timeout,
        )
    )


def test_the_work_queue_alone_gets_the_timeout_in_milliseconds() -> None:
    topology = plan(timedelta(hours=1))

    arguments = {queue.name: dict(queue.arguments) for queue in topology.queues}
    assert arguments["svc.report.work"][CONSUMER_TIMEOUT] == 3_600_000
    others = [name for name, args in arguments.items() if CONSUMER_TIMEOUT in args]
    assert others == ["svc.report.work"]
    assert "x-consumer-timeout=3600000" in " ".join(topology.describe())


def test_without_one_the_plan_is_as_before() -> None:
    assert all(CONSUMER_TIMEOUT not in queue.arguments for queue in plan(None).queues)
    assert unsupported(plan(None), "3.10.8") is None


@pytest.mark.parametrize("version", ["3.12.0", "3.13.7", "4.0.5", "4.3.0"])
def test_a_broker_from_3_12_takes_it(version: str) -> None:
    assert unsupported(plan(timedelta(hours=1)), version) is None


@pytest.mark.parametrize("version", ["3.10.8", "3.11.28", None, "unknown"])
def test_an_older_or_unknown_broker_is_refused_in_one_line(version: str | None) -> None:
    refusal = unsupported(plan(timedelta(hours=1)), version)

    assert refusal is not None
    assert "\n" not in refusal
    assert refusal.startswith("ack_timeout: RabbitMQ ")
    assert "svc.report.work" in refusal
    assert "RabbitMQ 3.12 and later" in refusal
    assert "raise consumer_timeout in rabbitmq.conf" in refusal
    assert "CONSUMER_BROKER_ACK_TIMEOUT" in refusal


def test_the_version_is_read_from_the_server_properties() -> None:
    assert broker_version({"version": "3.10.8", "product": "RabbitMQ"}) == "3.10.8"
    assert broker_version({"version": b"3.12.1"}) == "3.12.1"
    assert broker_version({}) is None
