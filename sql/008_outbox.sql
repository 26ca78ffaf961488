-- The transactional outbox. A row is an event to publish, written in the transaction whose effect
-- it announces: a handler's (`event.publish`, inside the service's own transaction) or an
-- application's (`consumer.outbox.enqueue`, inside its own). It commits or rolls back with that
-- effect, so a rolled-back transaction never publishes. The relay (inside the service) publishes
-- committed rows with publisher confirms and marks each one sent only after its confirm: a crash
-- between the two publishes the same event_id again, which the consumers' receipts absorb.
--
-- Range-partitioned on created_at (the database's clock, never a producer's), so that sent rows
-- leave like receipts: a whole partition dropped once it is older than the retention and holds
-- no unsent row. Rows are kept after they are sent (marked, not deleted): `consumer events show`
-- follows an event to the events it caused through caused_by.
CREATE TABLE outbox (
    id                 bigint      GENERATED ALWAYS AS IDENTITY,
    created_at         timestamptz NOT NULL DEFAULT now(),
    event_id           uuid        NOT NULL,
    type               text        NOT NULL,
    -- Rows that share a key are published in id order (the handler's `key` of the target type);
    -- NULL: no order to keep.
    order_key          text,
    -- The envelope, exactly the bytes the relay publishes (JSON), and the AMQP headers beside it.
    body               bytea       NOT NULL,
    headers            jsonb       NOT NULL DEFAULT '{}',
    -- The event whose handler wrote the row, and the consumer (CONSUMER_NAME) that ran it; NULL
    -- for an application's enqueue.
    caused_by          uuid,
    caused_by_consumer text,
    sent_at            timestamptz,
    -- Set when the broker refused the row for good (unroutable, too large): the relay skips it
    -- until `consumer outbox retry` clears it.
    failed_at          timestamptz,
    attempts           integer     NOT NULL DEFAULT 0,
    last_error         text,
    PRIMARY KEY (id, created_at)
) PARTITION BY RANGE (created_at);

-- The relay's work list: only the unsent rows, however many sent ones the partitions keep.
CREATE INDEX outbox_unsent ON outbox (id) WHERE sent_at IS NULL AND failed_at IS NULL;
CREATE INDEX outbox_event_id ON outbox (event_id);
CREATE INDEX outbox_caused_by ON outbox (caused_by) WHERE caused_by IS NOT NULL;

-- Wakes the relay at the commit of every transaction that wrote rows (a NOTIFY is delivered at
-- commit, folded to one per transaction and channel, and never for a rollback). A lost
-- notification is covered by the relay's slow poll.
CREATE FUNCTION consumer_outbox_notify() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    PERFORM pg_notify('consumer_outbox', '');
    RETURN NULL;
END
$$;

CREATE TRIGGER outbox_notify AFTER INSERT ON outbox
FOR EACH STATEMENT EXECUTE FUNCTION consumer_outbox_notify();

CREATE TABLE consumer_outbox_partitions (
    name    text        PRIMARY KEY,
    starts  timestamptz NOT NULL,
    ends    timestamptz NOT NULL
);

-- As consumer_receipts_extend (sql/005): partitions forward from the newest, created apart and
-- then attached, each lock waited for at most `lock_wait`.
CREATE FUNCTION consumer_outbox_extend(width interval, back interval, ahead interval,
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
        RAISE EXCEPTION 'an outbox partition spans at least a second, not %', width;
    END IF;
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_wait) * 1000)::bigint || 'ms',
                       true);
    SELECT max(ends) INTO lower FROM consumer_outbox_partitions;
    IF lower IS NULL THEN
        lower := date_bin(width, now() - back, timestamptz '2000-01-01 00:00:00+00');
    END IF;
    WHILE lower < now() + ahead LOOP
        upper := lower + width;
        partition := 'outbox_' || to_char(lower AT TIME ZONE 'UTC', 'YYYYMMDD"t"HH24MISS');
        EXECUTE format('CREATE TABLE %I (LIKE outbox INCLUDING DEFAULTS)', partition);
        EXECUTE format('ALTER TABLE outbox ATTACH PARTITION %I FOR VALUES FROM (%L) TO (%L)',
                       partition, lower, upper);
        INSERT INTO consumer_outbox_partitions (name, starts, ends) VALUES (partition, lower, upper);
        created := created + 1;
        lower := upper;
    END LOOP;
    RETURN created;
END
$$;

-- Drops every partition whose upper bound is older than `retention` and that holds no unsent
-- row (lists them only, with `dry_run`). A partition with a row still unsent (the relay behind,
-- or a row failed for good) is kept, however old: the outbox never drops what it owes.
CREATE FUNCTION consumer_outbox_prune(retention interval, lock_wait interval, dry_run boolean)
RETURNS TABLE (partition text, starts timestamptz, ends timestamptz, estimated_rows bigint)
LANGUAGE plpgsql SECURITY DEFINER SET search_path FROM CURRENT AS $$
DECLARE
    found record;
    unsent boolean;
    locked boolean := false;
BEGIN
    PERFORM set_config('lock_timeout', (extract(epoch FROM lock_wait) * 1000)::bigint || 'ms',
                       true);
    FOR found IN
        SELECT p.name, p.starts, p.ends FROM consumer_outbox_partitions p
        WHERE p.ends <= now() - retention
        ORDER BY p.starts
    LOOP
        EXECUTE format('SELECT EXISTS (SELECT FROM %I WHERE sent_at IS NULL)', found.name)
        INTO unsent;
        CONTINUE WHEN unsent;
        partition := found.name;
        starts := found.starts;
        ends := found.ends;
        SELECT greatest(c.reltuples, 0)::bigint INTO estimated_rows
        FROM pg_class c WHERE c.oid = to_regclass(found.name);
        IF NOT dry_run THEN
            IF NOT locked THEN
                -- outbox first, as every insert takes it (then its partition).
                LOCK TABLE ONLY outbox IN ACCESS EXCLUSIVE MODE;
                locked := true;
            END IF;
            EXECUTE format('DROP TABLE %I', found.name);
            DELETE FROM consumer_outbox_partitions p WHERE p.name = found.name;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;

REVOKE ALL ON FUNCTION consumer_outbox_extend(interval, interval, interval, interval) FROM PUBLIC;
REVOKE ALL ON FUNCTION consumer_outbox_prune(interval, interval, boolean) FROM PUBLIC;
GRANT EXECUTE ON FUNCTION consumer_outbox_extend(interval, interval, interval, interval)
    TO consumer_app;
GRANT EXECUTE ON FUNCTION consumer_outbox_prune(interval, interval, boolean) TO consumer_app;

-- The service writes rows (handlers), reads them and marks them (the relay, `consumer outbox`);
-- it never deletes one: sent rows leave with their partition. An application that enqueues
-- needs INSERT on outbox under its own role (docs/guide/outbox.md).
GRANT SELECT, INSERT ON outbox TO consumer_app;
GRANT UPDATE (sent_at, failed_at, attempts, last_error) ON outbox TO consumer_app;
GRANT SELECT ON consumer_outbox_partitions TO consumer_app;

-- A week back, three days ahead, a day each, as the receipts: the database takes rows as soon as
-- it is migrated; the service extends them at start-up and at every prune.
SELECT consumer_outbox_extend(interval '1 day', interval '7 days', interval '3 days',
                              interval '1 minute');
