"""``consumer topology check`` compares the broker's bindings with the plan's (pure part)."""

from __future__ import annotations

from consumer.config.settings import Settings
from consumer.service.components import topology_for
from topology.bindings import compare_bindings
from topology.model import Binding, Topology


def plan() -> Topology:
    settings = Settings.model_validate({"name": "svc", "retry_delays": "1s,5s"})
    return topology_for(settings, ["a.type", "b.type"])


def test_the_plan_s_own_bindings_are_in_place() -> None:
    assert compare_bindings(plan(), plan().bindings).describe() == []


def test_a_missing_type_binding_is_named() -> None:
    # Given the broker without the binding of one event type
    present = [b for b in plan().bindings if b.routing_key != "b.type"]

    differences = compare_bindings(plan(), present)

    assert differences.describe() == ["missing: bind events -> svc.work with routing key 'b.type'"]


def test_a_retry_binding_with_other_arguments_is_missing() -> None:
    present = [
        Binding(b.exchange, b.queue, b.routing_key, {**b.arguments, "consumer-retry-rung": "9s"})
        if b.queue == "svc.retry.5s"
        else b
        for b in plan().bindings
    ]

    differences = compare_bindings(plan(), present)

    assert [b.queue for b in differences.missing] == ["svc.retry.5s"]
    assert [b.queue for b in differences.unplanned] == ["svc.retry.5s"]


def test_a_binding_to_a_planned_queue_the_plan_has_not_is_named_others_are_not() -> None:
    # A type moved away still routed here; someone else's queue on the same exchange
    present = [
        *plan().bindings,
        Binding("events", "svc.work", "c.type"),
        Binding("events", "other.work", "z.type"),
    ]

    differences = compare_bindings(plan(), present)

    assert differences.describe() == [
        "not in the plan: bind events -> svc.work with routing key 'c.type'"
    ]
