"""Handlers and how the service finds them.

A handler is an async function ``(event, conn) -> None`` marked with :func:`register`, or a batch
handler ``(events, conn) -> results`` marked with :func:`register_batch`. The mark is an attribute
on the function, not an entry in a global table: the service builds its :class:`HandlerRegistry`
from the modules ``CONSUMER_HANDLERS`` names, at start-up.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from types import ModuleType
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import asyncpg
from pydantic import BaseModel, TypeAdapter, ValidationError

from consumer.durations import parse_duration
from consumer.envelope import EVENT_TYPE_PATTERN, Envelope, RawEnvelope
from consumer.error_text import error_name, message_of
from consumer.errors import BatchResultError, ConfigError, Poison, PoisonReason
from consumer.safe_text import describe_validation_error as _describe
from consumer.safe_text import one_line

if TYPE_CHECKING:
    Connection: TypeAlias = asyncpg.Connection[Any]
else:
    Connection = asyncpg.Connection

__all__ = [
    "BatchHandlerFunc",
    "BatchResult",
    "Handler",
    "HandlerFunc",
    "HandlerRegistry",
    "import_handler_module",
    "payload_problem",
    "register",
    "register_batch",
]
HandlerFunc: TypeAlias = Callable[[Envelope[Any], "asyncpg.Connection[Any]"], Awaitable[None]]
BatchResult: TypeAlias = Sequence[Exception | None]
BatchHandlerFunc: TypeAlias = Callable[
    [Sequence[Envelope[Any]], "asyncpg.Connection[Any]"], Awaitable[BatchResult]
]
F = TypeVar("F", bound=Callable[..., Awaitable[None]])
B = TypeVar("B", bound=Callable[..., Awaitable[BatchResult]])
G = TypeVar("G", bound=Callable[..., Awaitable[Any]])

_MARK = "__consumer_handler__"
_EVENT_TYPE = re.compile(EVENT_TYPE_PATTERN)


@dataclass(frozen=True, slots=True)
class Handler:
    """A registered handler: the function, the payload model it expects and its time limit."""

    event_type: str
    func: HandlerFunc
    payload: TypeAdapter[Any]
    timeout: timedelta | None = None
    key: Callable[[Any], Hashable] | None = None
    many: BatchHandlerFunc | None = None
    """The batch form, for a handler marked with :func:`register_batch` (``func`` then applies
    one event through it)."""
    payload_type: Any = None
    """What ``register(payload=)`` named (``payload`` validates it)."""

    @property
    def qualname(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"

    async def apply_many(
        self, events: Sequence[Envelope[Any]], conn: asyncpg.Connection[Any]
    ) -> list[Exception | None]:
        """The batch handler's verdict per event, checked: one ``None`` or exception each."""
        assert self.many is not None
        return _checked(self.qualname, await self.many(events, conn), len(events))

    def refusal(self, payload: object) -> str | None:
        """Why this handler's payload model refuses ``payload`` (one line), or None."""
        try:
            self.payload.validate_python(payload)
        except ValidationError as error:
            return _describe(error)
        except Exception as error:
            # A validator's own error pydantic lets through (a KeyError, a TypeError): the
            # service takes such a payload for poison (invalid_payload), so this refuses it too.
            return one_line(f"{error_name(error)}: {message_of(error)}", 300)
        return None

    def bind(self, raw: RawEnvelope) -> Envelope[Any]:
        """The envelope with its payload validated by this handler's model, or :class:`Poison`."""
        try:
            payload = self.payload.validate_python(raw.payload)
        except ValidationError as error:
            raise Poison(PoisonReason.INVALID_PAYLOAD, _describe(error)) from None
        return Envelope[Any].model_construct(
            event_id=raw.event_id,
            type=raw.type,
            occurred_at=raw.occurred_at,
            payload=payload,
            correlation_id=raw.correlation_id,
        )


def payload_problem(
    registry: Mapping[str, Handler], event_type: str, payload: object
) -> str | None:
    """Why the handler of ``event_type`` would refuse ``payload`` (one line), or None. The check
    is the handler's own payload model, the source of its schema (``consumer catalogue``), so
    what passes here is what the service takes. A type no handler registers is not checked:
    with no queue bound for it, the broker refuses the publish."""
    handler = registry.get(event_type)
    if handler is None:
        return None
    refusal = handler.refusal(payload)
    if refusal is None:
        return None
    return f"{event_type} payload refused by its schema: {refusal}"


def register(
    event_type: str,
    *,
    payload: type[BaseModel] | Any,
    timeout: str | timedelta | None = None,
    key: Callable[[Any], Hashable] | None = None,
) -> Callable[[F], F]:
    """Mark an async function as the handler of ``event_type``.

    ``payload`` is the pydantic model (or any type pydantic can validate) of the event's payload; a
    payload it rejects makes the message poison. ``timeout`` overrides ``CONSUMER_HANDLER_TIMEOUT``
    for this handler (``"2s"``, ``timedelta(...)``). ``key`` picks, from the validated payload,
    what the handler locks (a SKU, an account): events with equal keys go to the same worker of a
    process, one after another, so concurrent batches do not fight over those rows. It is not an
    ordering promise.

    ::

        @register("inventory.restock", payload=Restock)
        async def restock(event: Envelope[Restock], conn: asyncpg.Connection) -> None: ...
    """
    return _marker(event_type, payload, timeout, key, batch=False)


def register_batch(
    event_type: str,
    *,
    payload: type[BaseModel] | Any,
    timeout: str | timedelta | None = None,
    key: Callable[[Any], Hashable] | None = None,
) -> Callable[[B], B]:
    """Mark an async function as the batch handler of ``event_type``.

    It receives the events of a batch (in order, each new: duplicates are filtered out before) and
    the connection, and returns one result per event, in the same order: ``None`` when that event's
    effect is applied, or the exception that failed it, classified as if raised (a
    :class:`~consumer.errors.PermanentError` dead-letters it). An event it reports as failed must
    have no effect left behind. If it raises, no event is blamed yet: each is applied again alone,
    in a batch of one. The options are :func:`register`'s; ``timeout`` bounds each call.

    Use it when the effects of many events can be written in a few statements (``unnest`` of
    arrays): one round trip per batch instead of one per event.

    ::

        @register_batch("inventory.reserve", payload=Reserve, key=lambda r: r.sku)
        async def reserve(
            events: Sequence[Envelope[Reserve]], conn: Connection
        ) -> list[PermanentError | None]: ...
    """
    return _marker(event_type, payload, timeout, key, batch=True)


def _marker(
    event_type: str,
    payload: type[BaseModel] | Any,
    timeout: str | timedelta | None,
    key: Callable[[Any], Hashable] | None,
    *,
    batch: bool,
) -> Callable[[G], G]:
    if not _EVENT_TYPE.match(event_type):
        raise ConfigError(f"{event_type!r} is not a valid event type")
    try:
        limit = parse_duration(timeout) if timeout is not None else None
    except ValueError as error:
        raise ConfigError(f"timeout {timeout!r} of {event_type!r} {error}") from None

    def mark(func: G) -> G:
        if not inspect.iscoroutinefunction(cast(object, func)):
            raise ConfigError(f"handler {func.__qualname__} for {event_type!r} must be async")
        setattr(func, _MARK, (event_type, TypeAdapter(payload), limit, key, batch, payload))
        return func

    return mark


def import_handler_module(module_name: str) -> ModuleType:
    """A module ``CONSUMER_HANDLERS`` names, imported; one that cannot be is a ConfigError."""
    try:
        return importlib.import_module(module_name)
    except ImportError as error:
        raise ConfigError(f"CONSUMER_HANDLERS: cannot import {module_name!r}: {error}") from None


class HandlerRegistry(Mapping[str, Handler]):
    """The handlers the service runs, by event type. Immutable once built."""

    def __init__(self, handlers: Iterable[Handler]) -> None:
        by_type: dict[str, Handler] = {}
        for handler in handlers:
            if handler.event_type in by_type:
                first = by_type[handler.event_type]
                raise ConfigError(
                    f"CONSUMER_HANDLERS: two handlers for {handler.event_type!r}: "
                    f"{first.qualname} and {handler.qualname}"
                )
            by_type[handler.event_type] = handler
        self._by_type = by_type

    @classmethod
    def from_modules(cls, module_names: Iterable[str]) -> HandlerRegistry:
        """Import each module and collect the functions marked with :func:`register`."""
        handlers: list[Handler] = []
        for module_name in module_names:
            module = import_handler_module(module_name)
            found = list(_marked_functions(vars(module).values(), module_name))
            if not found:
                raise ConfigError(f"CONSUMER_HANDLERS: module {module_name!r} registers no handler")
            handlers.extend(found)
        return cls(handlers)

    def __getitem__(self, event_type: str) -> Handler:
        return self._by_type[event_type]

    def __iter__(self) -> Iterator[str]:
        return iter(sorted(self._by_type))

    def __len__(self) -> int:
        return len(self._by_type)

    def handler_for(self, raw: RawEnvelope) -> Handler:
        """The handler for an envelope's type, or :class:`Poison` (``unknown_type``)."""
        handler = self._by_type.get(raw.type)
        if handler is None:
            raise Poison(PoisonReason.UNKNOWN_TYPE, f"no handler for type {raw.type!r}")
        return handler

    def resolve(self, raw: RawEnvelope) -> tuple[Handler, Envelope[Any]]:
        """The handler for an envelope and the envelope bound to its payload model, or Poison."""
        handler = self.handler_for(raw)
        return handler, handler.bind(raw)


def _marked_functions(values: Iterable[object], module_name: str) -> Iterator[Handler]:
    for value in values:
        mark = getattr(value, _MARK, None)
        # Only functions defined in this module: an imported handler belongs to its own module.
        if mark is None or getattr(value, "__module__", None) != module_name:
            continue
        event_type, adapter, timeout, key, batch, payload = mark
        if batch:
            many = cast(BatchHandlerFunc, value)
            yield Handler(event_type, _one_at_a_time(many), adapter, timeout, key, many, payload)
        else:
            yield Handler(
                event_type, cast(HandlerFunc, value), adapter, timeout, key, None, payload
            )


def _one_at_a_time(many: BatchHandlerFunc) -> HandlerFunc:
    """A batch handler as a handler of one event: its failure raised, as a handler's would be."""

    qualname = f"{many.__module__}.{many.__qualname__}"

    @functools.wraps(many)
    async def one(event: Envelope[Any], conn: asyncpg.Connection[Any]) -> None:
        (failure,) = _checked(qualname, await many([event], conn), 1)
        if failure is not None:
            raise failure

    return one


def _checked(qualname: str, results: object, expected: int) -> list[Exception | None]:
    # A batch handler that miscounts would pin verdicts on the wrong events: refuse its answer.
    if not isinstance(results, Sequence) or len(results) != expected:
        count = len(results) if isinstance(results, Sequence) else type(results).__name__
        raise BatchResultError(f"{qualname} returned {count} results for {expected} events")
    checked = list(results)
    for result in checked:
        if result is not None and not isinstance(result, Exception):
            raise BatchResultError(
                f"{qualname} returned a {type(result).__name__}: expected None or an exception"
            )
    return checked
