-- consumer.testing's own tests (tests/handlers/kit.py): one row per applied event.
CREATE TABLE kit_effects (
    event_id  uuid NOT NULL,
    key       text NOT NULL
);
CREATE TABLE kit_taken (key text PRIMARY KEY);
INSERT INTO kit_taken VALUES ('taken');
