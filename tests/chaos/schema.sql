-- The chaos suite's tables for tests/handlers/behave.py, applied after the migrations. Like
-- tests/handlers/schema.sql, test_effects has no unique key on event_id: a second effect of the
-- same event is stored, and counted as a duplicate, instead of failing its transaction. The same
-- goes for the reference handlers' effects: their unique keys on event_id are dropped here, so a
-- second stock movement or notification of one event shows as a second row.
ALTER TABLE stock_movements DROP CONSTRAINT stock_movements_event_id_key;
CREATE INDEX stock_movements_event ON stock_movements (event_id);
ALTER TABLE notifications DROP CONSTRAINT notifications_event_id_key;
CREATE INDEX notifications_event ON notifications (event_id);

CREATE TABLE test_effects (
    event_id    uuid NOT NULL,
    key         text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX test_effects_event ON test_effects (event_id);

CREATE TABLE handler_calls (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id   uuid NOT NULL,
    pid        integer NOT NULL,
    called_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX handler_calls_event ON handler_calls (event_id);

CREATE TABLE batch_calls (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    size       integer NOT NULL,
    called_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- A key that is always taken: the swallowing handler's "insert or ignore" always conflicts.
CREATE TABLE test_taken (key text PRIMARY KEY);
INSERT INTO test_taken (key) VALUES ('taken');
