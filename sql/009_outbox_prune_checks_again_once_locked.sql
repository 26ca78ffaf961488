-- consumer_outbox_prune looked at a partition for unsent rows before it took the outbox's lock:
-- a writer that already held its lock on the outbox (an insert elsewhere) could commit a row
-- into that partition in the gap, and the drop took it. Now every partition is looked at again
-- once the lock is held (no insert can be in flight then), and one that holds an unsent row is
-- kept. A failed row (failed_at set, never sent) keeps its partition too: it waits for an
-- operator to give it back.
CREATE OR REPLACE FUNCTION consumer_outbox_prune(retention interval, lock_wait interval,
                                                 dry_run boolean)
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
        IF NOT dry_run THEN
            IF NOT locked THEN
                -- outbox first, as every insert takes it (then its partition).
                LOCK TABLE ONLY outbox IN ACCESS EXCLUSIVE MODE;
                locked := true;
                -- Again, now that no insert can be in flight: one may have committed a row
                -- here while this waited for the lock.
                EXECUTE format('SELECT EXISTS (SELECT FROM %I WHERE sent_at IS NULL)',
                               found.name)
                INTO unsent;
                CONTINUE WHEN unsent;
            END IF;
        END IF;
        partition := found.name;
        starts := found.starts;
        ends := found.ends;
        SELECT greatest(c.reltuples, 0)::bigint INTO estimated_rows
        FROM pg_class c WHERE c.oid = to_regclass(found.name);
        IF NOT dry_run THEN
            EXECUTE format('DROP TABLE %I', found.name);
            DELETE FROM consumer_outbox_partitions p WHERE p.name = found.name;
        END IF;
        RETURN NEXT;
    END LOOP;
END
$$;
