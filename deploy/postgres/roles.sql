-- The service's PostgreSQL roles and database, for an administrator to run with psql (once per
-- cluster, and again at will: it changes nothing that is already right):
--
--   psql "postgresql://postgres@db.example:5432/postgres?sslmode=verify-full" -X \
--        -v ON_ERROR_STOP=1 -v database=consumer -f deploy/postgres/roles.sql
--
--   consumer_migrate  owns the database and, through `consumer migrate`, every table.
--   consumer_app      what `consumer run` logs in as: CONNECT, and the table grants of the
--                     migrations (sql/002_app_role_grants.sql, the reference handlers' and each
--                     handler package's own): SELECT/INSERT/UPDATE/DELETE only where used.
--
-- Neither may create roles or databases, bypass row security or replicate. Passwords are not in
-- this file: set them with `\password consumer_app` in psql (hashed before it is sent), or pass
-- -v app_password_file=PATH -v migrate_password_file=PATH to read them from files (a superuser
-- then keeps the statements out of the server log). `database` defaults to consumer.

\if :{?database}
\else
    \set database consumer
\endif

-- Cluster-wide: the two login roles.
SELECT NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'consumer_migrate') AS create_migrate,
       NOT EXISTS (SELECT FROM pg_roles WHERE rolname = 'consumer_app') AS create_app \gset
\if :create_migrate
    CREATE ROLE consumer_migrate LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
        NOBYPASSRLS;
\endif
\if :create_app
    CREATE ROLE consumer_app LOGIN NOSUPERUSER NOCREATEDB NOCREATEROLE NOREPLICATION
        NOBYPASSRLS;
\endif
-- A migration may have made consumer_app without a login (see 002): give it one.
ALTER ROLE consumer_app LOGIN;
ALTER ROLE consumer_migrate LOGIN;

DO $$
DECLARE
    powerful text;
BEGIN
    SELECT string_agg(rolname, ', ') INTO powerful FROM pg_roles
    WHERE rolname IN ('consumer_app', 'consumer_migrate')
      AND (rolsuper OR rolcreaterole OR rolcreatedb OR rolreplication OR rolbypassrls);
    IF powerful IS NOT NULL THEN
        RAISE EXCEPTION 'role % has more than it needs (superuser, createrole, createdb, '
            'replication or bypassrls): take it away with ALTER ROLE, then run this again',
            powerful;
    END IF;
END
$$;

\if :{?app_password_file}
    SELECT rolsuper AS quiet_log FROM pg_roles WHERE rolname = current_user \gset
    \if :quiet_log
        SET log_statement = 'none';
    \endif
    \set app_password `cat :'app_password_file'`
    ALTER ROLE consumer_app PASSWORD :'app_password';
    \unset app_password
\endif
\if :{?migrate_password_file}
    SELECT rolsuper AS quiet_log FROM pg_roles WHERE rolname = current_user \gset
    \if :quiet_log
        SET log_statement = 'none';
    \endif
    \set migrate_password `cat :'migrate_password_file'`
    ALTER ROLE consumer_migrate PASSWORD :'migrate_password';
    \unset migrate_password
\endif

-- The database, owned by the migration role; nobody else may connect but the service.
SELECT format('CREATE DATABASE %I OWNER consumer_migrate', :'database')
WHERE NOT EXISTS (SELECT FROM pg_database WHERE datname = :'database') \gexec
ALTER DATABASE :"database" OWNER TO consumer_migrate;
REVOKE ALL ON DATABASE :"database" FROM PUBLIC;
GRANT CONNECT ON DATABASE :"database" TO consumer_app;

-- Inside it: only the owner creates objects (PostgreSQL 15's default; older versions let anyone
-- create in public), and the service may look up names in the schema.
\connect :"database"
REVOKE CREATE ON SCHEMA public FROM PUBLIC;
GRANT USAGE ON SCHEMA public TO consumer_app;
