"""What ``register`` records about a handler, read back through the registry."""

from __future__ import annotations

import sys
import types
import uuid
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import Any, cast

import pytest
from pydantic import BaseModel

from consumer.envelope import Envelope
from consumer.errors import BatchResultError, ConfigError, PermanentError
from consumer.handlers.inventory import Reserve, Restock
from consumer.registry import Handler, HandlerRegistry, register_batch

REGISTRY = HandlerRegistry.from_modules(["consumer.handlers.inventory"])


def test_inventory_handlers_share_one_key_per_sku() -> None:
    restock, reserve = REGISTRY["inventory.restock"], REGISTRY["inventory.reserve"]
    assert restock.key is not None
    assert reserve.key is not None
    # A restock and a reserve of one SKU lock the same row, so they must route alike.
    assert restock.key(Restock(sku="A-1", qty=1)) == reserve.key(
        Reserve(order_id="o-1", sku="A-1", qty=2)
    )
    assert restock.key(Restock(sku="A-1", qty=1)) != restock.key(Restock(sku="B-2", qty=1))


def test_a_handler_without_a_key_has_none() -> None:
    notifications = HandlerRegistry.from_modules(["consumer.handlers.notifications"])
    assert all(notifications[name].key is None for name in notifications)


def test_a_batch_handler_is_registered_with_its_one_event_form() -> None:
    reserve = REGISTRY["inventory.reserve"]
    assert reserve.many is not None
    # The one-event form carries the batch function's name: logs and errors name the real thing.
    assert reserve.qualname == "consumer.handlers.inventory.reserve"
    assert REGISTRY["inventory.restock"].many is None


class _Payload(BaseModel):
    n: int


def _event(n: int) -> Envelope[Any]:
    return Envelope[Any].model_construct(
        event_id=uuid.uuid4(), type="t.x", occurred_at=datetime.now(UTC), payload=_Payload(n=n)
    )


def _batch_handler(answer: Callable[[Sequence[Envelope[Any]]], object]) -> Handler:
    @register_batch("t.x", payload=_Payload)
    async def handle(events: Sequence[Envelope[Any]], conn: Any) -> Any:
        return answer(events)

    module = types.ModuleType("batch_handler_under_test")
    handle.__module__ = module.__name__
    module.handle = handle  # type: ignore[attr-defined]
    sys.modules[module.__name__] = module
    try:
        return HandlerRegistry.from_modules([module.__name__])["t.x"]
    finally:
        del sys.modules[module.__name__]


async def test_the_one_event_form_raises_what_the_batch_handler_reports() -> None:
    refused = PermanentError("no")
    handler = _batch_handler(lambda events: [refused if e.payload.n < 0 else None for e in events])
    await handler.func(_event(1), cast(Any, None))
    with pytest.raises(PermanentError) as raised:
        await handler.func(_event(-1), cast(Any, None))
    assert raised.value is refused
    assert await handler.apply_many([_event(1), _event(-1)], cast(Any, None)) == [None, refused]


@pytest.mark.parametrize(
    ("answer", "complaint"),
    [
        (lambda events: [], "returned 0 results for 2 events"),
        (lambda events: [None, None, None], "returned 3 results for 2 events"),
        (lambda events: None, "returned NoneType results for 2 events"),
        (lambda events: [None, "failed"], "returned a str: expected None or an exception"),
    ],
)
async def test_a_batch_handler_must_answer_once_per_event_with_none_or_an_exception(
    answer: Callable[[Sequence[Envelope[Any]]], object], complaint: str
) -> None:
    handler = _batch_handler(answer)
    with pytest.raises(BatchResultError, match=complaint):
        await handler.apply_many([_event(1), _event(2)], cast(Any, None))


def test_register_batch_refuses_a_function_that_is_not_async() -> None:
    with pytest.raises(ConfigError, match="must be async"):
        register_batch("t.x", payload=_Payload)(lambda events, conn: [])  # type: ignore[type-var]
