"""``consumer catalogue``: the AsyncAPI 3.0 document of examples/ validates against the official
schema (vendored: tests/asyncapi/), and its schemas accept what the handlers accept."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import jsonschema
import pytest
from pydantic import BaseModel, ConfigDict, TypeAdapter

from consumer.cli import catalogue
from consumer.cli.catalogue import asyncapi, payload_schemas
from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG
from consumer.registry import Handler, HandlerRegistry

REPO = Path(__file__).resolve().parents[2]
SCHEMA = REPO / "tests" / "asyncapi" / "asyncapi-3.0.0.schema.json"
HANDLERS = ("billing.handlers",)
EVENT = {
    "event_id": "0190f3c4-7a4b-7cc2-8f3e-6f5bd6a1e0a1",
    "occurred_at": "2026-01-02T03:04:05+00:00",
}


@pytest.fixture(scope="module")
def document() -> dict[str, Any]:
    settings = Settings(handlers=HANDLERS, name="billing", exchange="events")
    return asyncapi(settings, HandlerRegistry.from_modules(HANDLERS))


def asyncapi_validator() -> jsonschema.protocols.Validator:
    schema = json.loads(SCHEMA.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    return validator_class(schema)


def test_the_document_of_the_examples_is_valid_asyncapi_3(document: dict[str, Any]) -> None:
    errors = [
        f"{list(e.absolute_path)}: {e.message}" for e in asyncapi_validator().iter_errors(document)
    ]

    assert errors == []
    assert document["asyncapi"] == "3.0.0"


def test_the_validator_refuses_a_broken_document(document: dict[str, Any]) -> None:
    broken = json.loads(json.dumps(document))
    broken["channels"]["billing.charge"]["bindings"]["amqp"]["is"] = "queue"  # and an exchange

    assert not asyncapi_validator().is_valid(broken)


def test_each_type_has_its_routing_key_queue_and_handler(document: dict[str, Any]) -> None:
    channel = document["channels"]["billing.refund"]
    operation = document["operations"]["receive.billing.refund"]

    assert channel["address"] == "billing.refund"
    assert channel["bindings"]["amqp"]["exchange"]["name"] == "events"
    assert channel["bindings"]["amqp"]["x-queue"]["name"] == "billing.work"
    assert operation["action"] == "receive"
    assert "billing.handlers.refund" in operation["summary"]
    assert (
        "consumer-attempt"
        in document["components"]["messages"]["billing.refund"]["headers"]["properties"]
    )


def test_every_reference_in_the_document_resolves(document: dict[str, Any]) -> None:
    def refs(node: object) -> list[str]:
        if isinstance(node, dict):
            found = [node["$ref"]] if isinstance(node.get("$ref"), str) else []
            return found + [ref for value in node.values() for ref in refs(value)]
        if isinstance(node, list):
            return [ref for value in node for ref in refs(value)]
        return []

    for ref in refs(document):
        target: Any = document
        for part in ref.removeprefix("#/").split("/"):
            target = target[part]
        assert isinstance(target, dict), ref


def envelope_validator(document: dict[str, Any], event_type: str) -> jsonschema.protocols.Validator:
    payload = document["components"]["messages"][event_type]["payload"]
    # Its references point into the document's components: the document is the root.
    return jsonschema.Draft202012Validator({**payload, "components": document["components"]})


def test_the_envelope_schema_takes_a_valid_event_and_refuses_a_bad_one(
    document: dict[str, Any],
) -> None:
    charge = envelope_validator(document, "billing.charge")
    good: dict[str, Any] = {
        **EVENT,
        "type": "billing.charge",
        "payload": {"order_id": "o-1", "cents": 5},
    }

    assert charge.is_valid(good)
    assert not charge.is_valid({**good, "type": "billing.refund"})
    assert not charge.is_valid({**good, "payload": {"order_id": "o-1", "cents": 0}})
    assert not charge.is_valid({**good, "payload": {"order_id": "o-1", "cents": 5, "x": 1}})


def test_json_schema_format_gives_each_payload_schema_alone() -> None:
    schemas = payload_schemas(HandlerRegistry.from_modules(HANDLERS))

    assert sorted(schemas) == ["billing.charge", "billing.invoice", "billing.refund"]
    refund = jsonschema.Draft202012Validator(schemas["billing.refund"])
    assert refund.is_valid({"order_id": "o-1", "cents": 1})
    assert not refund.is_valid({"order_id": "", "cents": 1})


def test_the_command_prints_both_formats() -> None:
    env = {
        **os.environ,
        "CONSUMER_HANDLERS": ",".join(HANDLERS),
        "PYTHONPATH": str(REPO / "examples"),
    }
    command = [sys.executable, "-m", "consumer", "catalogue"]

    document = subprocess.run(command, env=env, capture_output=True, text=True, check=True)
    schemas = subprocess.run(
        [*command, "--format", "json-schema"], env=env, capture_output=True, text=True, check=True
    )

    assert asyncapi_validator().is_valid(json.loads(document.stdout))
    assert sorted(json.loads(schemas.stdout)) == [
        "billing.charge",
        "billing.invoice",
        "billing.refund",
    ]


class _Opaque:
    """A type pydantic checks with ``isinstance`` only: it can write no JSON Schema for it."""


class _OpaquePayload(BaseModel):
    model_config = ConfigDict(arbitrary_types_allowed=True)

    thing: _Opaque


async def _apply_opaque(event: Any, conn: Any) -> None:
    return None


def _opaque_registry() -> HandlerRegistry:
    handler = Handler(
        event_type="catalogue.opaque",
        func=_apply_opaque,
        payload=TypeAdapter(_OpaquePayload),
        payload_type=_OpaquePayload,
    )
    return HandlerRegistry([handler])


@pytest.mark.parametrize("form", ["asyncapi", "json-schema"])
def test_a_payload_model_with_no_json_schema_is_one_line_naming_its_type(
    form: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(catalogue, "load_handlers", lambda _: _opaque_registry())

    with pytest.raises(SystemExit) as exited:
        catalogue.run(Settings(), argparse.Namespace(format=form))

    assert exited.value.code == EXIT_CONFIG
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: catalogue.opaque: the payload model of ")
    assert "_apply_opaque has no JSON Schema" in err
