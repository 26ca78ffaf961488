-- Tables the test handlers write to; applied to the test template database after the migrations.
-- No unique key on event_id: a second effect of the same event is stored (and counted by the
-- tests as a double) instead of failing its transaction and hiding as a dead letter.
CREATE TABLE test_effects (
    event_id    uuid NOT NULL,
    key         text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX test_effects_event ON test_effects (event_id);

-- Every call of a test handler, written outside the event's transaction so it survives rollback.
CREATE TABLE handler_calls (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    event_id   uuid NOT NULL,
    pid        integer NOT NULL,
    called_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);
CREATE INDEX handler_calls_event ON handler_calls (event_id);

-- The size of every call of a batch test handler, written outside the event's transaction.
CREATE TABLE batch_calls (
    id         bigint GENERATED ALWAYS AS IDENTITY PRIMARY KEY,
    size       integer NOT NULL,
    called_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

-- A key that is always taken: the swallowing handler's "insert or ignore" always conflicts.
CREATE TABLE test_taken (key text PRIMARY KEY);
INSERT INTO test_taken (key) VALUES ('taken');
