"""What ``register`` records about a handler, read back through the registry."""

from __future__ import annotations

from consumer.handlers.inventory import Reserve, Restock
from consumer.registry import HandlerRegistry

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
