-- Crash attribution. An event redelivered after a process died (or held back after its database
-- connection broke) is applied alone, with nothing else in flight in its process, and marked here,
-- committed, before its handler runs; the event's own transaction deletes the mark. A mark left
-- behind by another process means that process died while applying this event and nothing else:
-- after CRASH_STRIKES such deaths the event is dead-lettered (reason `crashed`) instead of taking
-- its neighbours to the delivery limit. The watchdog writes `verdict = 'hard_time_limit'` for an
-- event it caught blocking the event loop, and the event is dead-lettered at its next delivery.
CREATE TABLE consumer_in_progress (
    consumer    text        NOT NULL,
    event_id    uuid        NOT NULL,
    owner       uuid        NOT NULL,
    crashes     integer     NOT NULL DEFAULT 0,
    verdict     text,
    detail      text,
    updated_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id)
);

-- The run-time role marks, counts and clears; it cannot touch receipts beyond inserting them.
GRANT SELECT, INSERT, UPDATE, DELETE ON consumer_in_progress TO consumer_app;
