-- Tables the test handlers write to; applied to the test template database after the migrations.
CREATE TABLE test_effects (
    event_id    uuid PRIMARY KEY,
    key         text NOT NULL,
    applied_at  timestamptz NOT NULL DEFAULT clock_timestamp()
);

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
