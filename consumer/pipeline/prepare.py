"""Preparing a delivery: its body parsed and validated, and bound to its handler; or poison.

The service's first step for every delivery (docs/internals/delivery-flow.md).
"""

from __future__ import annotations

import time
from datetime import UTC, datetime
from typing import Any, NamedTuple
from uuid import UUID
from weakref import WeakKeyDictionary

from pydantic import ValidationError

from consumer.amqp.delivery import Delivery
from consumer.amqp.headers import attempts_so_far
from consumer.db.retention import ReceiptWindow
from consumer.envelope import Envelope, RawEnvelope, set_attempt
from consumer.error_text import error_name, message_of
from consumer.errors import Poison, PoisonReason
from consumer.pipeline.calls import HandlerCall, HandlerCalls
from consumer.pipeline.envelope_parser import EnvelopeParser, check_content_type, check_routing_key
from consumer.pipeline.ready import Prepared
from consumer.registry import Handler, HandlerRegistry
from consumer.safe_text import one_line

__all__ = ["Identified", "Preparer", "ValidationCall", "named"]


class Identified(NamedTuple):
    """A delivery's envelope by the service's own model, and the body decoded for it."""

    envelope: RawEnvelope
    decoded: dict[str, Any]


class Preparer:
    """Parses and binds deliveries; any exception on the way is poison, never an unsettled
    delivery (pydantic lets through what a validator raises other than ``ValueError`` and
    ``AssertionError``). A handler's payload model is the handler's code: its validators run as
    a registered call (:mod:`consumer.pipeline.calls`), so that the watchdog can name an event whose
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
        self._max_age_s = window.max_age.total_seconds() if window is not None else 0.0
        # Per event type, the envelope model with the handler's payload model in it: a valid
        # event is validated in one pass; any other goes the long way, which says what is wrong.
        self._typed: dict[str, tuple[Handler, type[Envelope[Any]]]] = {}
        self._prepared: WeakKeyDictionary[Delivery, Prepared | Poison] = WeakKeyDictionary()
        for event_type, handler in registry.items():
            typed = parser.typed(handler.payload_type)
            if typed is not None:
                self._typed[event_type] = (handler, typed)

    def prepared(
        self, delivery: Delivery, identified: Identified | None = None
    ) -> Prepared | Poison:
        """The delivery prepared (or why it is poison), kept so that it is parsed once; from the
        body :meth:`identified` decoded already, when given."""
        prepared = self._prepared.get(delivery)
        if prepared is None:
            prepared = self._prepared[delivery] = self._prepare_or_poison(delivery, identified)
        return prepared

    def forget(self, delivery: Delivery) -> None:
        """Drop what was made of ``delivery``'s body: it is parsed again when it is applied, so
        that the prefetch holds bodies, not their many times larger objects
        (:mod:`consumer.service.memory`)."""
        self._prepared.pop(delivery, None)

    def identified(self, delivery: Delivery) -> Identified | Poison:
        """The delivery's envelope by the service's own model only (no handler's code runs):
        enough to know which event it is. The body it decoded goes on to :meth:`prepared`."""
        decoded: dict[str, Any] | None = None
        try:
            decoded = self._decoded(delivery)
            envelope = self._parser.validate(decoded)
            check_routing_key(delivery.routing_key, envelope.type)
            self._check_age(envelope)
        except Poison as poison:
            return named(poison, decoded)
        return Identified(envelope, decoded)

    def _prepare_or_poison(
        self, delivery: Delivery, identified: Identified | None
    ) -> Prepared | Poison:
        decoded: dict[str, Any] | None = None
        try:
            decoded = identified.decoded if identified is not None else self._decoded(delivery)
            prepared = self._prepare(delivery, decoded)
        except Poison as poison:
            return named(poison, decoded)
        except (KeyboardInterrupt, SystemExit):
            raise
        except BaseException as error:  # a validator's own BaseException too: all of it
            refused = Poison(
                PoisonReason.INVALID_PAYLOAD,
                one_line(f"{error_name(error)}: {message_of(error)}", 300),
                error_class=error_name(error),
            )
            return named(refused, decoded)
        # The retry count the service's own header carries (clamped, a producer's copy dropped
        # on arrival): absent on a first delivery, which keeps the default of 1.
        retries = attempts_so_far(delivery.headers)
        if retries:
            set_attempt(prepared.event, retries + 1)
        return prepared

    def _decoded(self, delivery: Delivery) -> dict[str, Any]:
        if delivery.body_discarded:
            limit = self._parser.limits.max_bytes
            raise Poison(
                PoisonReason.BODY_TOO_LARGE,
                f"{delivery.body_size} bytes, the limit is {limit} (dropped unread)",
                body_discarded=True,
            )
        check_content_type(delivery.content_type, delivery.content_encoding)
        self._parser.check_headers(delivery.headers)
        return self._parser.decode(delivery.body)

    def _prepare(self, delivery: Delivery, decoded: dict[str, Any]) -> Prepared:
        # One pass only under its own routing key: a misrouted body never meets the handler's
        # payload validators, and is judged the long way (the envelope, then the routing key).
        routing_key = delivery.routing_key
        typed = self._typed.get(routing_key) if decoded.get("type") == routing_key else None
        calls = self._calls
        if typed is not None:
            handler, model = typed
            # Registered by hand, not with a context manager: this runs for every delivery.
            task = calls.enter(ValidationCall(handler, decoded, delivery.message_id))
            try:
                event = model.model_validate(decoded)
            except ValidationError:
                pass
            else:
                self._check_times(event)
                return Prepared(handler, event)
            finally:
                calls.leave(task)
        raw = self._parser.validate(decoded)
        check_routing_key(delivery.routing_key, raw.type)
        self._check_age(raw)
        handler = self._registry.handler_for(raw)
        task = calls.enter(ValidationCall(handler, decoded, delivery.message_id))
        try:
            return Prepared(handler, handler.bind(raw))
        finally:
            calls.leave(task)

    def _check_times(self, event: Envelope[Any]) -> None:
        """Not from the future, and not too old to be applied: one clock reading for both."""
        now = time.time()
        occurred = event.occurred_at.timestamp()
        self._parser.check_skew_at(event, occurred, now)
        if self._window is not None and occurred < now - self._max_age_s:
            self._window.check(event, datetime.now(UTC))

    def _check_age(self, event: Envelope[Any]) -> None:
        # Before any handler code runs (the payload's validators included): an event too old
        # for its receipt to be kept is never applied.
        if self._window is not None:
            self._window.check(event, datetime.now(UTC))


def named(poison: Poison, decoded: dict[str, Any] | None) -> Poison:
    """``poison`` with the type its body names, if the body was decoded and names one as text
    (cut to the envelope's limit: the line carries it; the metrics bound it to the registered
    types, :meth:`consumer.observe.metrics.Metrics.type_label`)."""
    if decoded is not None:
        event_type = decoded.get("type")
        if isinstance(event_type, str) and event_type:
            poison.event_type = event_type[:_TYPE_LIMIT]
    return poison


_TYPE_LIMIT = 255


class ValidationCall:
    """A payload's validation as the watchdog names it: described only if the watchdog asks,
    which is when a validator has blocked the event loop (it costs nothing otherwise)."""

    __slots__ = ("_decoded", "_handler", "_message_id")

    def __init__(self, handler: Handler, decoded: dict[str, Any], message_id: str | None) -> None:
        self._handler = handler
        self._decoded = decoded
        self._message_id = message_id

    @property
    def handler(self) -> str:
        return f"{self._handler.qualname} (payload validation)"

    @property
    def event_ids(self) -> tuple[UUID, ...]:
        try:
            return (UUID(str(self._decoded.get("event_id"))),)
        except ValueError:
            return ()  # no event to name: the envelope is poison anyway

    def describe(self) -> dict[str, Any]:
        call = HandlerCall(self.handler, self._handler.event_type, self.event_ids, self._message_id)
        return call.describe()
