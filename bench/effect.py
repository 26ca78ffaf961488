"""The effect Celery and Dramatiq apply, with psycopg 3: the service's receipt + reserve, one
transaction, the same statements and round trips (BEGIN, receipt, reserve, seal, COMMIT).

The SQL mirrors ``_INSERT_ONE`` in ``consumer/db/receipts.py`` and ``_RESERVE`` in
``consumer/handlers/inventory.py`` (copied, not imported, so that the competitors keep doing the
reference effect while the service is being changed). The seal: receipts commit only in a
transaction that set ``consumer.sealed`` (``sql/004``), as the service does just before COMMIT;
the peers set it plainly (they run no handler that could end the transaction).
"""

from __future__ import annotations

import threading
import uuid
from collections.abc import Mapping
from typing import Any

import psycopg  # type: ignore[import-not-found, unused-ignore]

INSERT_RECEIPT = """
INSERT INTO receipts (consumer, event_id, type, occurred_at)
SELECT %(consumer)s, %(event_id)s, %(type)s, %(occurred_at)s::timestamptz
WHERE NOT EXISTS (
    SELECT FROM receipts_legacy WHERE consumer = %(consumer)s AND event_id = %(event_id)s
)
ON CONFLICT DO NOTHING
RETURNING true
"""

RESERVE = """
WITH reserved AS (
    UPDATE stock SET available = available - %(qty)s
    WHERE sku = %(sku)s AND available >= %(qty)s
    RETURNING sku
)
INSERT INTO stock_movements (event_id, order_id, sku, delta)
SELECT %(event_id)s, %(order_id)s, sku, -%(qty)s FROM reserved
RETURNING id
"""


SEAL = "SELECT set_config('consumer.sealed', 'yes', true)"


class EffectFailed(Exception):
    """Unknown SKU or too little stock: the service would dead-letter the event."""


class Connections:
    """One psycopg connection per thread (per process for Celery's prefork children)."""

    def __init__(self, dsn: str) -> None:
        self._dsn = dsn
        self._local = threading.local()

    def get(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed:
            conn = psycopg.connect(self._dsn, autocommit=True)
            self._local.conn = conn
        return conn


def apply_reserve(conn: psycopg.Connection[Any], consumer: str, event: Mapping[str, Any]) -> bool:
    """Receipt + reserve in one transaction; False if the receipt was there (a duplicate)."""
    event_id = uuid.UUID(str(event["event_id"]))
    payload = event["payload"]
    with conn.transaction():
        receipt = {
            "consumer": consumer,
            "event_id": event_id,
            "type": event["type"],
            "occurred_at": str(event["occurred_at"]),
        }
        fresh = conn.execute(INSERT_RECEIPT, receipt).fetchone()
        if fresh is None:
            return False
        params = {
            "event_id": event_id,
            "order_id": str(payload["order_id"]),
            "sku": str(payload["sku"]),
            "qty": int(payload["qty"]),
        }
        if conn.execute(RESERVE, params).fetchone() is None:
            raise EffectFailed(f"cannot reserve {params['qty']} of {params['sku']!r}")
        conn.execute(SEAL)
    return True
