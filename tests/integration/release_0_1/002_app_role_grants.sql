-- The service's run-time role, consumer_app, may only read and write the rows it needs; the
-- tables stay owned by the role that runs the migrations. Roles belong to the whole cluster and
-- carry passwords, so they are made by deploy/postgres/roles.sql (run once by an administrator),
-- not here. This file only grants. Where that script has not run (a developer's superuser), the
-- role is created without a login so the grants have somewhere to go.
DO $$
BEGIN
    IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'consumer_app') THEN
        IF NOT EXISTS (
            SELECT FROM pg_roles
            WHERE rolname = current_user AND (rolsuper OR rolcreaterole)
        ) THEN
            RAISE EXCEPTION 'role consumer_app does not exist and % cannot create it: run '
                'deploy/postgres/roles.sql as an administrator first', current_user;
        END IF;
        BEGIN
            CREATE ROLE consumer_app NOLOGIN;
        EXCEPTION WHEN duplicate_object OR unique_violation THEN
            NULL;  -- a migration of another database on this cluster made it meanwhile
        END;
    END IF;
END
$$;

-- Exactly what the pipeline and the reference handlers do. A migration that adds a table a
-- handler writes grants on it in the same file.
--   receipts: INSERT ... ON CONFLICT DO NOTHING RETURNING, never UPDATE or DELETE: the service
--   cannot undo what records an effect as applied.
GRANT SELECT, INSERT ON receipts TO consumer_app;
--   stock: upsert on restock, conditional UPDATE ... RETURNING on reserve, SELECT on refusal.
GRANT SELECT, INSERT, UPDATE ON stock TO consumer_app;
--   stock_movements: INSERT ... RETURNING id (the identity needs no sequence grant).
GRANT SELECT, INSERT ON stock_movements TO consumer_app;
--   notifications: INSERT only; the sender that marks them sent is another role's business.
GRANT INSERT ON notifications TO consumer_app;
