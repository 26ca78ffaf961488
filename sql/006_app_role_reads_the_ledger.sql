-- consumer run refuses to start while a migration of its sets is pending (a handler deployed
-- before its tables would send every event down the retry ladder): it reads the ledger as the
-- run-time role to know. Read only: which files were applied, and their checksums; the role
-- still cannot write the ledger or run a migration.
GRANT SELECT ON consumer_migrations TO consumer_app;
