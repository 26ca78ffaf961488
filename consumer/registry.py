"""Handlers and how the service finds them.

A handler is an async function ``(event, conn) -> None`` marked with :func:`register`. The mark is
an attribute on the function, not an entry in a global table: the service builds its
:class:`HandlerRegistry` from the modules ``CONSUMER_HANDLERS`` names, at start-up.
"""

from __future__ import annotations

import importlib
import inspect
import re
from collections.abc import Awaitable, Callable, Hashable, Iterable, Iterator, Mapping
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar, cast

import asyncpg
from pydantic import BaseModel, TypeAdapter, ValidationError

from consumer.durations import parse_duration
from consumer.envelope import EVENT_TYPE_PATTERN, Envelope, Poison, PoisonReason, RawEnvelope
from consumer.envelope import describe_validation_error as _describe
from consumer.errors import ConfigError

if TYPE_CHECKING:
    Connection: TypeAlias = asyncpg.Connection[Any]
else:
    Connection = asyncpg.Connection
HandlerFunc: TypeAlias = Callable[[Envelope[Any], "asyncpg.Connection[Any]"], Awaitable[None]]
F = TypeVar("F", bound=Callable[..., Awaitable[None]])

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

    @property
    def qualname(self) -> str:
        return f"{self.func.__module__}.{self.func.__qualname__}"

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
    if not _EVENT_TYPE.match(event_type):
        raise ConfigError(f"{event_type!r} is not a valid event type")
    limit = parse_duration(timeout) if timeout is not None else None

    def mark(func: F) -> F:
        if not inspect.iscoroutinefunction(cast(object, func)):
            raise ConfigError(f"handler {func.__qualname__} for {event_type!r} must be async")
        setattr(func, _MARK, (event_type, TypeAdapter(payload), limit, key))
        return func

    return mark


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
            try:
                module = importlib.import_module(module_name)
            except ImportError as error:
                raise ConfigError(
                    f"CONSUMER_HANDLERS: cannot import {module_name!r}: {error}"
                ) from None
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

    def resolve(self, raw: RawEnvelope) -> tuple[Handler, Envelope[Any]]:
        """The handler for an envelope and the envelope bound to its payload model, or Poison."""
        handler = self._by_type.get(raw.type)
        if handler is None:
            raise Poison(PoisonReason.UNKNOWN_TYPE, f"no handler for type {raw.type!r}")
        return handler, handler.bind(raw)


def _marked_functions(values: Iterable[object], module_name: str) -> Iterator[Handler]:
    for value in values:
        mark = getattr(value, _MARK, None)
        # Only functions defined in this module: an imported handler belongs to its own module.
        if mark is None or getattr(value, "__module__", None) != module_name:
            continue
        event_type, adapter, timeout, key = mark
        func = cast(HandlerFunc, value)
        yield Handler(event_type=event_type, func=func, payload=adapter, timeout=timeout, key=key)
