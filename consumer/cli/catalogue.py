"""``consumer catalogue``: the events the service takes, as an AsyncAPI 3.0 document made from
the registered handlers (``CONSUMER_HANDLERS``), or their payloads' JSON Schemas alone.

Each event type is a channel: its address is the routing key (the type) on the ingress exchange
(``CONSUMER_EXCHANGE``, topic), bound to the work queue (``x-queue`` on the channel's AMQP
binding); a ``receive`` operation names the handler. Its message is the envelope, whose
``payload`` is the handler's pydantic model (its JSON Schema, in ``components.schemas``), and
the headers a producer may set or the service writes on its copies. Nothing connects to the
broker or the database: the document is the code's.
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from typing import Any
from urllib.parse import urlsplit

from pydantic import PydanticUserError, TypeAdapter
from pydantic.json_schema import models_json_schema

from consumer.amqp import headers as h
from consumer.config.settings import Settings, split_urls
from consumer.config.startup import EXIT_CONFIG, fail, load_handlers
from consumer.envelope import Envelope
from consumer.errors import ConfigError
from consumer.registry import Handler, HandlerRegistry
from consumer.service.components import names_for
from consumer.version import __version__
from topology.names import RETRY_RUNG

__all__ = ["ASYNCAPI_VERSION", "add_catalogue_parser", "asyncapi", "payload_schemas", "run"]

ASYNCAPI_VERSION = "3.0.0"
AMQP_BINDING = "0.3.0"
_REF = "#/components/schemas/{model}"


def add_catalogue_parser(commands: Any) -> None:
    catalogue = commands.add_parser(
        "catalogue",
        help="print the events the handlers take: an AsyncAPI 3.0 document",
        description="Print, from the handlers CONSUMER_HANDLERS registers, an AsyncAPI 3.0 "
        "document (JSON) of the events the service takes: each type's routing key, queue, "
        "envelope, payload schema and headers. No broker or database is needed.",
    )
    catalogue.add_argument(
        "--format",
        choices=("asyncapi", "json-schema"),
        default="asyncapi",
        help="asyncapi (default), or json-schema: each type's payload schema alone",
    )


def run(settings: Settings, arguments: argparse.Namespace) -> int:
    registry = load_handlers(settings)
    try:
        if arguments.format == "json-schema":
            document = payload_schemas(registry)
        else:
            document = asyncapi(settings, registry)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    json.dump(document, sys.stdout, indent=2, ensure_ascii=False)
    sys.stdout.write("\n")
    return 0


def payload_schemas(registry: HandlerRegistry) -> dict[str, Any]:
    """Each event type's payload JSON Schema (draft 2020-12, as pydantic writes it), by type."""
    schemas: dict[str, Any] = {}
    for event_type, handler in registry.items():
        schema = _payload_schema(event_type, handler)
        schemas[event_type] = {
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            **schema,
        }
    return schemas


def asyncapi(settings: Settings, registry: HandlerRegistry) -> dict[str, Any]:
    """The AsyncAPI 3.0 document of the events ``registry``'s handlers take."""
    for event_type, handler in registry.items():
        _payload_schema(event_type, handler)  # one line naming a model with no schema
    names = names_for(settings)
    envelopes, schemas = _envelopes(registry)
    channels: dict[str, Any] = {}
    operations: dict[str, Any] = {}
    messages: dict[str, Any] = {}
    for event_type, handler in registry.items():
        key = _key(event_type)
        messages[key] = _message(event_type, handler, envelopes[event_type])
        channels[key] = {
            "address": event_type,
            "title": event_type,
            "description": f"Routing key {event_type!r} on exchange {names.ingress!r}, bound to "
            f"queue {names.work!r}.",
            "messages": {key: {"$ref": f"#/components/messages/{key}"}},
            "bindings": {
                "amqp": {
                    "is": "routingKey",
                    "exchange": {
                        "name": names.ingress,
                        "type": "topic",
                        "durable": True,
                        "autoDelete": False,
                        "vhost": settings.amqp_vhost,
                    },
                    "x-queue": {"name": names.work, "type": "quorum", "durable": True},
                    "bindingVersion": AMQP_BINDING,
                }
            },
        }
        operations[f"receive.{key}"] = {
            "action": "receive",
            "channel": {"$ref": f"#/channels/{key}"},
            "title": f"Apply {event_type}",
            "summary": f"{handler.qualname} applies it, exactly once.",
            "messages": [{"$ref": f"#/channels/{key}/messages/{key}"}],
            "bindings": {"amqp": {"ack": True, "bindingVersion": AMQP_BINDING}},
        }
    return {
        "asyncapi": ASYNCAPI_VERSION,
        "info": {
            "title": f"{settings.name}: the events it takes",
            "version": __version__,
            "description": "Made by `consumer catalogue` from the handlers of "
            f"CONSUMER_HANDLERS ({', '.join(settings.handlers)}). Publish each event as a "
            "persistent JSON message whose routing key is its type; its receipt makes it "
            "applied once per (event_id, occurred_at).",
        },
        "defaultContentType": "application/json",
        "servers": _servers(settings),
        "channels": channels,
        "operations": operations,
        "components": {
            "messages": messages,
            "schemas": schemas,
        },
    }


def _payload_schema(event_type: str, handler: Handler) -> dict[str, Any]:
    """The handler's payload JSON Schema, or :class:`ConfigError` naming the type and handler
    if pydantic cannot write one (a field of a type it only checks with ``isinstance``)."""
    try:
        return TypeAdapter(handler.payload_type).json_schema(mode="validation")
    except PydanticUserError as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ConfigError(
            f"{event_type}: the payload model of {handler.qualname} has no JSON Schema ({first})"
        ) from None


def _key(event_type: str) -> str:
    """A component key for an event type (``^[\\w.-]+$``: types already are)."""
    return event_type


def _envelopes(registry: HandlerRegistry) -> tuple[dict[str, dict[str, Any]], dict[str, Any]]:
    """Each type's envelope schema (its payload a reference into the components' schemas, its
    ``type`` fixed), and the components' schemas: the payload models and what they refer to."""
    models = {
        event_type: Envelope[handler.payload_type]  # type: ignore[name-defined]
        for event_type, handler in registry.items()
    }
    unique = list(dict.fromkeys(models.values()))
    refs, definitions = models_json_schema(
        [(model, "validation") for model in unique], ref_template=_REF
    )
    schemas: dict[str, Any] = dict(definitions.get("$defs", {}))
    envelopes: dict[str, dict[str, Any]] = {}
    envelope_names: set[str] = set()
    for event_type, model in models.items():
        name = refs[(model, "validation")]["$ref"].rsplit("/", 1)[1]
        envelope_names.add(name)
        schema = copy.deepcopy(schemas[name])
        schema["title"] = f"{event_type} envelope"
        schema["properties"]["type"] = {
            "const": event_type,
            "description": "The event's type: also its routing key.",
        }
        schema["properties"]["event_id"]["description"] = (
            "Unique per event (UUIDv4 or v7); a copy with the same event_id and occurred_at is a "
            "duplicate, applied once."
        )
        schema["properties"]["occurred_at"]["description"] = (
            "RFC 3339 with an offset; sent again unchanged with the same event_id."
        )
        envelopes[event_type] = schema
    for name in envelope_names:
        del schemas[name]
    return envelopes, schemas


def _message(event_type: str, handler: Handler, envelope: dict[str, Any]) -> dict[str, Any]:
    timeout = f" within {handler.timeout.total_seconds():g}s" if handler.timeout else ""
    return {
        "name": event_type,
        "title": event_type,
        "summary": f"Applied by {handler.qualname}{timeout}.",
        "contentType": "application/json",
        "headers": HEADERS,
        "payload": envelope,
        "correlationId": {
            "description": "The envelope's correlation_id, if the producer gives one.",
            "location": "$message.payload#/correlation_id",
        },
        "bindings": {
            "amqp": {"messageType": event_type, "bindingVersion": AMQP_BINDING},
        },
    }


def _servers(settings: Settings) -> dict[str, Any]:
    servers: dict[str, Any] = {}
    for index, url in enumerate(split_urls(settings.amqp_url.get_secret_value())):
        parts = urlsplit(url)
        host = parts.hostname or "localhost"
        port = parts.port or (5671 if parts.scheme == "amqps" else 5672)
        servers[f"rabbitmq{index + 1 if index else ''}"] = {
            "host": f"{host}:{port}",
            "protocol": parts.scheme or "amqp",
            "protocolVersion": "0.9.1",
            "description": "CONSUMER_AMQP_URL (credentials left out)",
        }
    return servers


_SERVICE_WRITES = (
    "Written by the service on its retry and dead-letter copies; a producer's is dropped on "
    "arrival."
)

HEADERS: dict[str, Any] = {
    "type": "object",
    "description": "AMQP headers. A producer needs none; the service's own (consumer-*) are "
    "dropped when a producer sets them, except consumer-replays.",
    "properties": {
        "traceparent": {
            "type": "string",
            "description": "W3C trace context: the service's span continues the trace.",
        },
        "tracestate": {"type": "string", "description": "W3C trace context, with traceparent."},
        h.ATTEMPT: {
            "type": "integer",
            "minimum": 0,
            "description": "Retries published so far for the event. " + _SERVICE_WRITES,
        },
        RETRY_RUNG: {
            "type": "string",
            "description": "The rung of the retry ladder a copy waits on (5s). " + _SERVICE_WRITES,
        },
        h.FIRST_FAILURE_AT: {"type": "string", "format": "date-time"},
        h.LAST_FAILURE_AT: {"type": "string", "format": "date-time"},
        h.ERROR_CLASS: {"type": "string", "description": "What the handler raised."},
        h.ERROR_MESSAGE: {"type": "string", "maxLength": h.ERROR_MESSAGE_LIMIT},
        h.REASON: {
            "type": "string",
            "description": "Why a dead letter was dead-lettered (permanent_failure, "
            "retries_exhausted, a poison reason...). " + _SERVICE_WRITES,
        },
        h.DEAD_LETTERED_AT: {"type": "string", "format": "date-time"},
        h.SERVICE: {
            "type": "string",
            "description": "CONSUMER_NAME of the dead-lettering service.",
        },
        h.QUEUE: {
            "type": "string",
            "description": "The queue of the service's queue table (CONSUMER_QUEUES_FILE) the "
            "event was dead-lettered from; absent without a table. " + _SERVICE_WRITES,
        },
        h.ORIGINAL_EXCHANGE: {"type": "string"},
        h.ORIGINAL_ROUTING_KEY: {"type": "string"},
        h.REPLAYS: {
            "type": "integer",
            "minimum": 0,
            "description": "Times an operator replayed the event from the dead-letter queue.",
        },
    },
    "additionalProperties": True,
}
