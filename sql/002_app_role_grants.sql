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

-- Exactly what the pipeline does. Every migration set that adds a table a handler writes grants
-- on it in its own files (this set runs first, so the role exists by then).
--   receipts: INSERT ... ON CONFLICT DO NOTHING RETURNING, never UPDATE or DELETE: the service
--   cannot undo what records an effect as applied.
GRANT SELECT, INSERT ON receipts TO consumer_app;
