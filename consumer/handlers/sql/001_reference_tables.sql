-- The reference handlers' domain: an order's stock deduction and its notification. This set is
-- applied only when consumer.handlers.inventory or consumer.handlers.notifications is in
-- CONSUMER_HANDLERS, so a database with tables of these names of its own is left alone.
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
