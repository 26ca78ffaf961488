-- The invoices issued (billing.invoice): one number per order, kept once.
CREATE TABLE invoices (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    uuid        NOT NULL UNIQUE,
    order_id    text        NOT NULL UNIQUE,
    number      text        NOT NULL UNIQUE,
    created_at  timestamptz NOT NULL DEFAULT now()
);

GRANT SELECT, INSERT ON invoices TO consumer_app;
