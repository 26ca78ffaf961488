-- A receipt commits only with the service's own COMMIT. (A deferred check fires early on SET
-- CONSTRAINTS ALL IMMEDIATE too, which handlers must therefore not run: they name their
-- constraints instead.) A handler that runs COMMIT itself would
-- otherwise commit the receipts of its whole batch, including those of events whose handlers have
-- not run yet: acked later as duplicates, they would have no effect. The service seals each
-- transaction just before its COMMIT (a transaction-local setting); a COMMIT without the seal is
-- refused here, so nothing of the transaction commits, and the service applies the batch again
-- event by event and dead-letters the handler that ended it.
CREATE FUNCTION consumer_receipt_sealed() RETURNS trigger
LANGUAGE plpgsql AS $$
BEGIN
    IF current_setting('consumer.sealed', true) IS DISTINCT FROM 'yes' THEN
        RAISE EXCEPTION 'receipts commit only with the consumer''s own COMMIT'
            USING ERRCODE = 'invalid_transaction_termination',
                  HINT = 'a handler must not COMMIT, ROLLBACK or SET CONSTRAINTS ALL IMMEDIATE '
                         '(name its constraints instead); use a savepoint';
    END IF;
    RETURN NULL;
END
$$;

CREATE CONSTRAINT TRIGGER receipts_commit_only_with_the_service
AFTER INSERT ON receipts
DEFERRABLE INITIALLY DEFERRED
FOR EACH ROW EXECUTE FUNCTION consumer_receipt_sealed();
