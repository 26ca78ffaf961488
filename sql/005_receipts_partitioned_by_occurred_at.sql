-- Receipts that leave in bulk. `receipts` becomes a table range-partitioned on the event's
-- occurred_at, which every copy of an event carries unchanged (a producer's retry re-sends the
-- same envelope): every copy of an event lands in the same partition, so the primary key
-- (consumer, event_id, occurred_at) keeps deduplicating it. A whole partition is dropped once its
-- upper bound is older than the retention (CONSUMER_RECEIPT_RETENTION); a range once dropped is
-- never created again, so no receipt can be written for an event that old: the service
-- dead-letters it (reason `expired`), and if a copy slipped past that check the insert itself
-- fails (no partition), which dead-letters it too.
--
-- The old table is kept, renamed, as receipts_legacy: read-only, consulted by every receipt
-- insert (an event applied before this migration is still a duplicate), and emptied whole by the
-- pruner once its newest receipt is older than the retention. Renaming is a catalogue change:
-- consumers wait only for the lock, whatever the number of rows (README: "Receipts retention").
ALTER TABLE receipts RENAME TO receipts_legacy;
ALTER INDEX receipts_pkey RENAME TO receipts_legacy_pkey;
DROP TRIGGER receipts_commit_only_with_the_service ON receipts_legacy;
REVOKE INSERT ON receipts_legacy FROM consumer_app;

CREATE TABLE receipts (
    consumer     text        NOT NULL,
    event_id     uuid        NOT NULL,
    type         text        NOT NULL,
    occurred_at  timestamptz NOT NULL,
    received_at  timestamptz NOT NULL DEFAULT now(),
    PRIMARY KEY (consumer, event_id, occurred_at)
) PARTITION BY RANGE (occurred_at);
GRANT SELECT, INSERT ON receipts TO consumer_app;

-- The seal (sql/004), on the new table: PostgreSQL 15 clones a row trigger of a partitioned
-- table onto each partition, those attached later included.
CREATE CONSTRAINT TRIGGER receipts_commit_only_with_the_service
AFTER INSERT ON receipts
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION consumer_receipt_sealed();

-- The partitions and their bounds, kept by the functions below (cheaper to read than the
-- catalogue's partition bound expressions). receipts_legacy has a row too: `ends` is its newest
-- receipt's received_at, found by the first prune (null until then).
CREATE TABLE consumer_receipt_partitions (
    name    text        PRIMARY KEY,
    starts  timestamptz NOT NULL,
    ends    timestamptz
);
INSERT INTO consumer_receipt_partitions (name, starts) VALUES ('receipts_legacy', '-infinity');
GRANT SELECT ON consumer_receipt_partitions TO consumer_app;

-- The run-time role may not create or drop tables: these functions do it for it, as their owner
-- (the role that runs the migrations), and do nothing else. Each waits at most `lock_wait` for a
-- lock, so that consumers queued behind it wait no longer than that (and the statement's few
-- milliseconds); a refused lock fails the call, to be tried again at the next run.
CREATE FUNCTION consumer_receipts_extend(width interval, back interval, ahead interval,
                                         lock_wait interval)
RETURNS integer
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    lower timestamptz;
    upper timestamptz;
    partition text;
    created integer := 0;
BEGIN
    IF width < interval '1 second' THEN
        RAISE EXCEPTION 'a receipt partition spans at least a second, not %', width;
    END IF;
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_wait) * 1000)::bigint || 'ms',
                       true);
    -- Only ever forward from the newest partition: a range dropped must never come back.
    SELECT max(ends) INTO lower FROM consumer_receipt_partitions WHERE name <> 'receipts_legacy';
    IF lower IS NULL THEN
        lower := date_bin(width, now() - back, timestamptz '2000-01-01 00:00:00+00');
    END IF;
    WHILE lower < now() + ahead LOOP
        upper := lower + width;
        partition := 'receipts_' || to_char(lower AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS');
        -- Created apart, then attached: ATTACH takes a SHARE UPDATE EXCLUSIVE lock on
        -- receipts, which inserts do not wait for (CREATE ... PARTITION OF would take ACCESS
        -- EXCLUSIVE).
        EXECUTE format('CREATE TABLE %I (LIKE receipts INCLUDING DEFAULTS)', partition);
        EXECUTE format('ALTER TABLE receipts ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       partition, lower, upper);
        INSERT INTO consumer_receipt_partitions (name, starts, ends)
        VALUES (partition, lower, upper);
        created := created + 1;
        lower := upper;
    END LOOP;
    RETURN created;
END
$$;

-- Drops every partition whose upper bound is older than `retention` (lists them only, with
-- `dry_run`), and empties receipts_legacy once its newest receipt is. Dropping a partition takes
-- an ACCESS EXCLUSIVE lock on receipts for a moment: no rows are deleted one by one.
CREATE FUNCTION consumer_receipts_prune(retention interval, lock_wait interval, dry_run boolean)
RETURNS TABLE (partition text, starts timestamptz, ends timestamptz, estimated_rows bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    found record;
    legacy_ends timestamptz;
    locked boolean := false;
BEGIN
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_wait) * 1000)::bigint || 'ms',
                       true);
    IF EXISTS (SELECT FROM consumer_receipt_partitions p
               WHERE p.name = 'receipts_legacy' AND p.ends IS NULL) THEN
        -- Once: the legacy table takes no more inserts. An empty one is wholly old.
        SELECT coalesce(max(received_at) + interval '1 microsecond', '-infinity')
        INTO legacy_ends FROM receipts_legacy;
        IF NOT dry_run THEN
            UPDATE consumer_receipt_partitions p SET ends = legacy_ends
            WHERE p.name = 'receipts_legacy';
        END IF;
    END IF;
    FOR found IN
        SELECT p.name, p.starts, coalesce(p.ends, legacy_ends) AS ends
        FROM consumer_receipt_partitions p
        WHERE coalesce(p.ends, legacy_ends) <= now() - retention
        ORDER BY p.starts
    LOOP
        partition := found.name;
        starts := found.starts;
        ends := found.ends;
        SELECT greatest(c.reltuples, 0)::bigint INTO estimated_rows
        FROM pg_class c WHERE c.oid = to_regclass(found.name);
        IF NOT dry_run THEN
            IF NOT locked THEN
                -- receipts first, as every insert takes it (then its partitions, and
                -- receipts_legacy): taking a partition first would deadlock with an insert
                -- that holds receipts and waits for that partition.
                LOCK TABLE ONLY receipts IN ACCESS EXCLUSIVE MODE;
                locked := true;
            END IF;
            IF found.name = 'receipts_legacy' THEN
                -- Emptied, not dropped: every receipt insert reads it.
                TRUNCATE receipts_legacy;
            ELSE
                EXECUTE format('DROP TABLE %I', found.name);
            END IF;
            DELETE FROM consumer_receipt_partitions p WHERE p.name = found.name;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION consumer_receipts_extend(interval, interval, interval, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION consumer_receipts_prune(interval, interval, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION consumer_receipts_extend(interval, interval, interval, interval)
    TO consumer_app;
GRANT EXECUTE ON FUNCTION consumer_receipts_prune(interval, interval, boolean) TO consumer_app;

-- Partitions for the default window (a week back, three days ahead, a day each), so that the
-- database takes receipts as soon as it is migrated; the service extends them with its own
-- settings at start-up and at every prune.
SELECT consumer_receipts_extend(interval '1 day', interval '7 days', interval '3 days',
                                interval '1 minute');
