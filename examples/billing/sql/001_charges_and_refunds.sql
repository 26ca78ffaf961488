-- billing's tables. `consumer migrate` applies this set (billing.sql) after the service's own,
-- which makes the run-time role consumer_app that the grant below names.
CREATE TABLE charges (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    uuid        NOT NULL UNIQUE,
    order_id    text        NOT NULL,
    cents       bigint      NOT NULL CHECK (cents > 0),
    currency    text        NOT NULL,
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX charges_order_id ON charges (order_id);

CREATE TABLE refunds (
    id          bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id    uuid        NOT NULL UNIQUE,
    order_id    text        NOT NULL,
    cents       bigint      NOT NULL CHECK (cents > 0),
    created_at  timestamptz NOT NULL DEFAULT now()
);
CREATE INDEX refunds_order_id ON refunds (order_id);

-- Exactly what the handlers do: insert, and read the sums.
GRANT SELECT, INSERT ON charges, refunds TO consumer_app;
