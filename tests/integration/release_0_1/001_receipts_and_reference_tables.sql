-- Idempotency receipts: one row per event a consumer has applied. The receipt and the event's
-- effect commit in the same transaction, so a row here means the effect exists, exactly once.
CREATE TABLE receipts (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    type         text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- The reference handlers' domain: an order's stock deduction and its notification.
CREATE TABLE stock (
    sku        text PRIMARY KEY,
    available  integer NOT NULL CHECK (available >= 0)
);

CREATE TABLE stock_movements (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    uuid        NOT NULL UNIQUE,
    order_id    text,
    sku         text        NOT NULL REFERENCES stock (sku),
    delta       integer     NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);

CREATE TABLE notifications (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    uuid        NOT NULL UNIQUE,
    recipient   text        NOT NULL,
    template    text        NOT NULL,
    params      jsonb       NOT NULL DEFAULT '{}'::jsonb,
    created_at  timestamptz NOT NULL DEFAULT now(),
    sent_at     timestamptz
);
