-- The chaos suite's tables for tests/handlers/behave.py, applied after the migrations. Unlike
-- tests/handlers/schema.sql, test_effects has no unique key on event_id: a second effect of the
-- same event is stored, and counted as a duplicate, instead of failing its transaction.
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
