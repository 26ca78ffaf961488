-- Idempotency receipts: one row per event a consumer has applied. The receipt and the event's
-- effect commit in the same transaction, so a row here means the effect exists, exactly once.
-- The reference handlers' tables are not here: they are their own migration set
-- (consumer/handlers/sql), applied only where those handlers are enabled.
CREATE TABLE receipts (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    type         text        NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);
