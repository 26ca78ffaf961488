"""Preparing a delivery: its body parsed and validated, and bound to its handler; or poison.

Internal: the service's first step for every delivery (see the README's "How it works").
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

from pydantic import ValidationError

from consumer.calls import HandlerCall, HandlerCalls
from consumer.delivery import Delivery, Prepared
from consumer.envelope import (
    Envelope,
    EnvelopeParser,
    RawEnvelope,
    check_content_type,
    one_line,
)
from consumer.errors import Poison, PoisonReason, error_name, message_of
from consumer.registry import Handler, HandlerRegistry
from consumer.retention import ReceiptWindow

__all__ = ["Preparer"]


class Preparer:
    """Parses and binds deliveries; any exception on the way is poison, never an unsettled
    delivery (pydantic lets through what a validator raises other than ``ValueError`` and
    ``AssertionError``). A handler's payload model is the handler's code: its validators run as
    a registered call (:mod:`consumer.calls`), so that the watchdog can name an event whose
    validator blocks the event loop."""

    def __init__(
        self,
        registry: HandlerRegistry,
        parser: EnvelopeParser,
        calls: HandlerCalls | None = None,
        window: ReceiptWindow | None = None,
    ) -> None:
        self._registry = registry
        self._parser = parser
        self._window = window
        self._calls = calls or HandlerCalls()
        # Per event type, the envelope model with the handler's payload model in it: a valid
        # event is validated in one pass; any other goes the long way, which says what is wrong.
        self._typed: dict[str, tuple[Handler, type[Envelope[Any]]]] = {}
        for event_type, handler in registry.items():
            typed = parser.typed(handler.payload_type)
            if typed is not None:
                self._typed[event_type] = (handler, typed)

    def prepared(self, delivery: Delivery) -> Prepared | Poison:
        """The delivery prepared (or why it is poison), kept on it so that it is parsed once."""
        if delivery.prepared is None:
            try:
                delivery.prepared = self._prepare(delivery)
            except Poison as poison:
                delivery.prepared = poison
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as error:  # a validator's own BaseException too: all of it
                delivery.prepared = Poison(
                    PoisonReason.INVALID_PAYLOAD,
                    one_line(f"{error_name(error)}: {message_of(error)}", 300),
                    error_class=error_name(error),
                )
        return delivery.prepared

    def envelope(self, delivery: Delivery) -> RawEnvelope | Poison:
        """The delivery's envelope by the service's own model alone (no handler's code runs):
        enough to know which event it is."""
        try:
            envelope = self._parser.validate(self._decoded(delivery))
            self._check_age(envelope)
        except Poison as poison:
            return poison
        return envelope

    def _decoded(self, delivery: Delivery) -> dict[str, Any]:
        check_content_type(delivery.content_type, delivery.content_encoding)
        self._parser.check_headers(delivery.headers)
        return self._parser.decode(delivery.body)

    def _prepare(self, delivery: Delivery) -> Prepared:
        decoded = self._decoded(delivery)
        event_type = decoded.get("type")
        typed = self._typed.get(event_type) if isinstance(event_type, str) else None
        if typed is not None:
            handler, model = typed
            try:
                with self._validating(handler, decoded, delivery):
                    event = model.model_validate(decoded)
            except ValidationError:
                pass
            else:
                self._parser.check_skew(event)
                self._check_age(event)
                return Prepared(handler, event)
        raw = self._parser.validate(decoded)
        self._check_age(raw)
        handler = self._registry.handler_for(raw)
        with self._validating(handler, decoded, delivery):
            return Prepared(handler, handler.bind(raw))

    def _check_age(self, event: Envelope[Any]) -> None:
        # Before any handler code runs (the payload's validators included): an event too old
        # for its receipt to be kept is never applied.
        if self._window is not None:
            self._window.check(event, datetime.now(UTC))

    @contextmanager
    def _validating(
        self, handler: Handler, decoded: dict[str, Any], delivery: Delivery
    ) -> Iterator[None]:
        try:
            event_id = UUID(str(decoded.get("event_id")))
        except ValueError:
            yield  # no event to name: the envelope is poison anyway
            return
        call = HandlerCall(
            handler=f"{handler.qualname} (payload validation)",
            event_type=handler.event_type,
            event_ids=(event_id,),
            message_id=delivery.message_id,
        )
        with self._calls.entered(call):
            yield
