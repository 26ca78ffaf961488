"""The transactional outbox's writing half: rows written in the transaction whose effect they
announce (sql/008), for the relay to publish once that transaction has committed.

Two ways in. A handler calls ``await event.publish(type, payload)``
(:meth:`consumer.envelope.Envelope.publish`): the call's rows are collected in a
:class:`Publishes` and written, in one statement, in the handler's own transaction when it returns
(``consumer.pipeline.follow_ups``). An application calls :func:`enqueue` in its own asyncpg
transaction. Either way a rolled-back transaction leaves no row, so it never publishes.

A row's ``body`` is the envelope exactly as ``consumer publish`` sends it
(:func:`consumer.envelope.envelope_body`), and a handler's row takes an ``event_id`` derived from
the event that caused it (:func:`follow_up_id`): a handler run again, after a rollback or in a
batch re-applied without its culprit, writes the same ids.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Any

from pamqp.commands import Basic
from pydantic_core import PydanticSerializationError, to_jsonable_python

from consumer.envelope import EVENT_TYPE_PATTERN, Envelope, envelope_body
from consumer.errors import InvalidPublish, OutboxMisuse

if TYPE_CHECKING:
    import asyncpg

    from consumer.registry import Handler

__all__ = ["FOLLOW_UP_NAMESPACE", "OutboxRow", "Publishes", "enqueue", "follow_up_id", "write_rows"]

FOLLOW_UP_NAMESPACE = uuid.UUID("5d0b7c1e-3f0a-5e53-9a1c-6f7574626f78")
"""The uuid5 namespace of follow-up ids. Never change it: a handler run again after a release
that did would write its follow-ups under new ids, and they would be published twice."""

_EVENT_TYPE = re.compile(EVENT_TYPE_PATTERN)
_MAX_TYPE = 255

_INSERT = """
INSERT INTO outbox (event_id, type, order_key, body, headers, caused_by, caused_by_consumer)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7)
"""


@dataclass(frozen=True, slots=True)
class OutboxRow:
    """One row of ``outbox`` as written: the event to publish and where it came from."""

    event_id: uuid.UUID
    type: str
    body: bytes
    order_key: str | None = None
    headers: Mapping[str, Any] = field(default_factory=dict)
    caused_by: uuid.UUID | None = None
    caused_by_consumer: str | None = None

    def record(self) -> tuple[Any, ...]:
        """The statement's arguments, in :data:`_INSERT`'s order."""
        return (
            self.event_id,
            self.type,
            self.order_key,
            self.body,
            json.dumps(dict(self.headers), separators=(",", ":")),
            self.caused_by,
            self.caused_by_consumer,
        )


def follow_up_id(cause: uuid.UUID, consumer: str, position: int) -> uuid.UUID:
    """The ``event_id`` of the ``position``-th event (from 0) the handler of consumer
    ``consumer`` published for event ``cause``. As unguessable as ``cause`` itself, and the same
    every time the handler runs for it."""
    return uuid.uuid5(FOLLOW_UP_NAMESPACE, f"{consumer}\n{cause}\n{position}")


def _type_problem(event_type: object) -> str | None:
    if not isinstance(event_type, str) or not _EVENT_TYPE.match(event_type):
        return f"{event_type!r} is not an event type (dot-separated words of [A-Za-z0-9_-])"
    if len(event_type) > _MAX_TYPE:
        return f"an event type is at most {_MAX_TYPE} characters, not {len(event_type)}"
    return None


def _headers_problem(headers: Mapping[str, Any]) -> str | None:
    """Why ``headers`` cannot go out as an AMQP table (an integer past 64 bits, a value that is
    not JSON), or None: the relay would fail such a row for good, unsent."""
    try:
        json.dumps(dict(headers))
        Basic.Properties(headers=dict(headers)).marshal()
    except (TypeError, ValueError) as error:
        return f"the headers cannot be sent as AMQP headers: {error}"
    return None


def _as_json(payload: object) -> Any:
    """``payload`` as JSON values (a model dumped as its JSON form); ``ValueError`` if it cannot
    be."""
    try:
        return to_jsonable_python(payload)
    except PydanticSerializationError as error:
        raise ValueError(f"the payload is not JSON: {error}") from None


class Publishes:
    """The events one handler call publishes for one event, in the order it publishes them: what
    :meth:`consumer.envelope.Envelope.publish` adds to, checked as each is added.

    ``handlers``: the service's own, by type. A type among them is checked against its handler's
    payload model, and takes its handler's ``key`` as the order key unless the publish names one.
    """

    __slots__ = ("_calls", "_cause", "_consumer", "_handlers", "rows")

    def __init__(
        self, cause: Envelope[Any], *, consumer: str, handlers: Mapping[str, Handler]
    ) -> None:
        self._cause = cause
        self._consumer = consumer
        self._handlers = handlers
        self._calls = 0
        self.rows: list[OutboxRow] = []

    def add(self, event_type: str, payload: Any, key: object) -> uuid.UUID:
        """The row for one publish, appended; its event id. :class:`InvalidPublish` for one that
        cannot be sent as asked (it still takes its position, so the ids after it stay put)."""
        position = self._calls
        self._calls += 1
        problem = _type_problem(event_type)
        if problem is not None:
            raise InvalidPublish(f"published {problem}")
        try:
            data = _as_json(payload)
        except ValueError as error:
            raise InvalidPublish(f"published {event_type}: {error}") from None
        handler = self._handlers.get(event_type)
        if handler is not None:
            refusal = handler.refusal(data)
            if refusal is not None:
                raise InvalidPublish(
                    f"published {event_type} with a payload its handler "
                    f"{handler.qualname} refuses: {refusal}"
                )
        # As text, whatever the handler passed (an int or a UUID id): the column is text, and
        # the same id then orders as the target's own key function's, which is made text too.
        order_key = str(key) if key is not None else None
        if handler is not None and order_key is None:
            order_key = _order_key(handler, data)
        cause = self._cause
        event_id = follow_up_id(cause.event_id, self._consumer, position)
        try:
            body = envelope_body(
                event_type,
                data,
                event_id=event_id,
                occurred_at=datetime.now(UTC),
                correlation_id=cause.correlation_id or str(cause.event_id),
            )
        except ValueError as error:
            problem = f"the payload is not JSON: {error}"
            raise InvalidPublish(f"published {event_type}: {problem}") from None
        self.rows.append(
            OutboxRow(
                event_id=event_id,
                type=event_type,
                body=body,
                order_key=order_key,
                caused_by=cause.event_id,
                caused_by_consumer=self._consumer,
            )
        )
        return event_id


def _order_key(handler: Handler, data: Any) -> str | None:
    """The target handler's ``key`` of the payload, as text; None without one, or when it fails
    (the order of the rows is then not kept, as the handler's own routing does without it)."""
    if handler.key is None:
        return None
    try:
        return str(handler.key(handler.payload.validate_python(data)))
    except Exception:
        return None


async def write_rows(conn: asyncpg.Connection[Any], rows: Sequence[OutboxRow]) -> None:
    """Insert ``rows`` in one statement, in the transaction open on ``conn``."""
    await conn.executemany(_INSERT, [row.record() for row in rows])


async def enqueue(
    conn: asyncpg.Connection[Any],
    type: str,
    payload: Any,
    *,
    key: object = None,
    event_id: uuid.UUID | None = None,
    correlation_id: str | None = None,
    occurred_at: datetime | None = None,
    headers: Mapping[str, Any] | None = None,
) -> uuid.UUID:
    """Write one event to the outbox in the transaction open on ``conn``, for the service's relay
    to publish once that transaction commits; its ``event_id`` (``event_id`` or a new UUIDv4).

    ``payload``: a pydantic model or anything pydantic can turn into JSON. ``key``: rows that
    share it are published in the order written (as text: an int id is its ``str()``).
    ``headers``: AMQP headers to send with it.

    ::

        async with conn.transaction():
            await conn.execute("UPDATE orders SET state = 'paid' WHERE id = $1", order_id)
            await enqueue(conn, "payment.captured", {"order_id": order_id}, key=str(order_id))

    Raises :class:`~consumer.errors.OutboxMisuse` outside a transaction (the row would commit
    on its own, whatever became of the rest), for a type that is no event type, a payload
    that is not JSON, or headers that cannot go out as an AMQP table. The payload is not checked
    against any handler's model: the application has no registry; the consumer of the type
    refuses what its model does."""
    if not conn.is_in_transaction():
        raise OutboxMisuse(
            "enqueue needs the caller's transaction open on the connection "
            "(`async with conn.transaction():`): alone, its row would commit without the effect"
        )
    problem = _type_problem(type)
    if problem is not None:
        raise OutboxMisuse(problem)
    try:
        data = _as_json(payload)
    except ValueError as error:
        raise OutboxMisuse(f"{type}: {error}") from None
    problem = _headers_problem(headers or {})
    if problem is not None:
        raise OutboxMisuse(f"{type}: {problem}")
    event_id = event_id or uuid.uuid4()
    try:
        body = envelope_body(
            type, data, event_id=event_id, occurred_at=occurred_at, correlation_id=correlation_id
        )
    except ValueError as error:
        raise OutboxMisuse(f"{type}: the payload is not JSON: {error}") from None
    row = OutboxRow(
        event_id=event_id,
        type=type,
        body=body,
        order_key=str(key) if key is not None else None,
        headers=dict(headers or {}),
    )
    await conn.execute(_INSERT, *row.record())
    return event_id
