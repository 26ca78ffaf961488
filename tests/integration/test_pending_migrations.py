"""``consumer run`` refuses to start, naming them, while a migration of its sets is pending: the
service's own and its handler modules'. The run-time role reads the ledger to know."""

from __future__ import annotations

import asyncpg

from tests.security.support import one_line_error
from tests.support import TestEnv, fetchval, run_cli


async def _forget(env: TestEnv, label: str) -> None:
    """The ledger loses ``label``'s row: as if the file had been deployed and not yet applied."""
    migration_set, _, filename = label.partition("/")
    await fetchval(
        env.database_url,
        "DELETE FROM consumer_migrations WHERE migration_set = $1 AND filename = $2",
        migration_set,
        filename,
    )


async def test_run_refuses_to_start_while_a_handler_sets_migration_is_pending(
    env: TestEnv,
) -> None:
    # Given a database where the reference handlers' second migration is pending
    await env.apply_topology()
    await _forget(env, "consumer.handlers.sql/002_app_role_grants.sql")

    # When the service starts
    result = run_cli("consumer", "run", env=env.env())

    # Then it stops at once, with one line naming the file and what to do
    assert one_line_error(result, 1) == (
        "error: migrations pending: consumer.handlers.sql/002_app_role_grants.sql: "
        "run `consumer migrate` first"
    )


async def test_run_names_a_few_of_many_pending_migrations_and_counts_the_rest(
    env: TestEnv,
) -> None:
    await env.apply_topology()
    for name in (
        "001_receipts.sql",
        "002_app_role_grants.sql",
        "003_in_progress_marks.sql",
        "004_receipts_commit_only_with_the_service.sql",
        "005_receipts_partitioned_by_occurred_at.sql",
        "006_app_role_reads_the_ledger.sql",
    ):
        await _forget(env, f"consumer.sql/{name}")

    line = one_line_error(run_cli("consumer", "run", env=env.env()), 1)

    assert line.startswith("error: migrations pending: consumer.sql/001_receipts.sql, ")
    assert line.endswith(" and 1 more: run `consumer migrate` first")


async def test_the_run_time_role_may_read_the_ledger_and_not_write_it(env: TestEnv) -> None:
    count = await fetchval(
        env.database_url,
        "SELECT count(*) FROM (SELECT has_table_privilege('consumer_app', 'consumer_migrations', "
        "p) AS granted FROM unnest(ARRAY['SELECT', 'INSERT', 'UPDATE', 'DELETE']) AS p) AS t "
        "WHERE granted",
    )
    assert count == 1
    assert await fetchval(
        env.database_url,
        "SELECT has_table_privilege('consumer_app', 'consumer_migrations', 'SELECT')",
    )


async def test_a_role_that_may_not_read_the_ledger_is_told_so_in_one_line(
    env: TestEnv, admin_dsn: str
) -> None:
    # Given a role that may do all the service does but read the migrations ledger
    role = f"{env.name}_noledger"
    database = env.database_url.rsplit("/", 1)[1]
    conn = await asyncpg.connect(env.database_url)
    try:
        await conn.execute(f'CREATE ROLE "{role}" LOGIN')
        await conn.execute(f'GRANT CONNECT ON DATABASE "{database}" TO "{role}"')
        await conn.execute(f'GRANT SELECT ON receipts, consumer_in_progress TO "{role}"')
        await env.apply_topology()

        # When the service starts as that role
        limited = env.database_url.replace("postgres@", f"{role}@")
        result = run_cli("consumer", "run", env=env.env(database_url=limited))

        # Then it stops with one line saying what to grant
        line = one_line_error(result, 1)
        assert "may not read the migrations ledger (consumer_migrations)" in line
    finally:
        await conn.execute(f'REVOKE ALL ON ALL TABLES IN SCHEMA public FROM "{role}"')
        await conn.execute(f'REVOKE ALL ON DATABASE "{database}" FROM "{role}"')
        await conn.close()
        admin = await asyncpg.connect(admin_dsn)
        await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        await admin.execute(f'DROP ROLE IF EXISTS "{role}"')
        await admin.close()
