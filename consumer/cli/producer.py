"""Publishing events the way producers should: persistent, JSON, routing key = type, confirmed."""

from __future__ import annotations

import json
import shlex
import uuid
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from pamqp.commands import Basic

from consumer.amqp.connect import BrokerConfig, connect
from consumer.amqp.publisher import PERSISTENT, Publisher
from consumer.envelope import envelope_body
from consumer.errors import ConfigError, Unroutable
from consumer.pipeline.tracing import Tracing, publish_span
from consumer.registry import HandlerRegistry
from topology.names import SHARD_KEY

__all__ = [
    "PublishRequest",
    "envelope_body",
    "event_properties",
    "publish_event",
    "repeat_command",
    "shard_key",
]


@dataclass(frozen=True, slots=True)
class PublishRequest:
    event_type: str
    payload: dict[str, Any] | None = None
    raw_body: bytes | None = None
    event_id: uuid.UUID | None = None
    correlation_id: str | None = None
    occurred_at: datetime | None = None
    """Default: now. A retry of a publish must send the first one's: the receipts deduplicate on
    (event_id, occurred_at)."""
    shard_key: str | None = None
    """What a sharded queue hashes (:func:`shard_key`); default: the event id."""


def shard_key(registry: HandlerRegistry | None, event_type: str, payload: object) -> str | None:
    """The text of what the handler of ``event_type`` locks (its ``key`` of the validated
    ``payload``), which a sharded queue's hash exchange hashes (the ``consumer-shard-key``
    header): events with equal keys go to the same shard. ``None`` when the type's handler has
    no key, or it cannot be had from this payload: the event id stands in then."""
    handler = registry.get(event_type) if registry is not None else None
    if handler is None or handler.key is None:
        return None
    try:
        return str(handler.key(handler.payload.validate_python(payload)))
    except Exception:
        # As the service does with a failing key function: the event still goes, by its id.
        return None


def repeat_command(request: PublishRequest, event_id: uuid.UUID, occurred_at: datetime) -> str:
    """The command line that publishes the same event again (same id and occurred_at: a
    duplicate the receipts catch, or the event again where it was lost)."""
    argv = ["consumer", "publish", "--type", request.event_type]
    if request.raw_body is not None:
        argv += ["--raw-body", request.raw_body.decode("utf-8", errors="replace")]
    else:
        payload = json.dumps(request.payload or {}, separators=(",", ":"), ensure_ascii=False)
        argv += ["--payload", payload]
        argv += ["--event-id", str(event_id), "--occurred-at", occurred_at.isoformat()]
        if request.correlation_id is not None:
            argv += ["--correlation-id", request.correlation_id]
    return shlex.join(argv)


def event_properties(
    *, message_id: str | None = None, shard_key: str | None = None
) -> Basic.Properties:
    """Persistent JSON, as the contract asks of producers; with ``shard_key``, the header a
    sharded queue hashes."""
    return Basic.Properties(
        content_type="application/json",
        delivery_mode=PERSISTENT,
        message_id=message_id,
        headers={SHARD_KEY: shard_key} if shard_key is not None else None,
    )


async def publish_event(
    broker: BrokerConfig,
    exchange: str,
    request: PublishRequest,
    *,
    tracing: Tracing | None = None,
) -> uuid.UUID:
    """Publish one event to ``exchange`` (the ingress) and wait for the confirm; its event id.

    With ``tracing`` on, the publish starts a trace (its ``traceparent`` goes with the event)."""
    event_id = request.event_id or uuid.uuid4()
    if request.raw_body is not None:
        body = request.raw_body
    else:
        body = envelope_body(
            request.event_type,
            request.payload or {},
            event_id=event_id,
            occurred_at=request.occurred_at,
            correlation_id=request.correlation_id,
        )
    connection = await connect(broker, "publish")
    try:
        channel = await connection.channel(publisher_confirms=True, on_return_raises=True)
        publisher = await Publisher.on(
            channel, confirm_within=timedelta(seconds=broker.publish_timeout)
        )
        properties = event_properties(
            message_id=str(event_id), shard_key=request.shard_key or str(event_id)
        )
        try:
            with publish_span(
                tracing or Tracing(),
                properties,
                exchange=exchange,
                routing_key=request.event_type,
            ):
                await publisher.publish(
                    body, properties, exchange=exchange, routing_key=request.event_type
                )
        except Unroutable as error:
            raise ConfigError(
                f"{error}: is the topology applied (`consumer topology apply`) and a handler "
                f"registered for {request.event_type!r}?"
            ) from None
    finally:
        await connection.close()
    return event_id
