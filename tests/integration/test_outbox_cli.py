"""``consumer outbox list|show|retry`` against a real database: the rows by state, one row in
full, failed rows given back to the relay as the run-time role, and the error paths."""

from __future__ import annotations

import asyncio
import json
import uuid
from typing import Any

import asyncpg

from consumer.db.outbox_admin import retry_failed
from consumer.outbox import enqueue
from tests.integration.test_outbox_relay import RESTOCK, relay, sent
from tests.support import TestEnv, drain_queue, fetch, run_cli, wait_until

_REFUSED = "unroutable: no queue is bound for t.refused"


async def _three_rows(env: TestEnv) -> tuple[uuid.UUID, uuid.UUID, uuid.UUID]:
    """One row owed, one sent, one failed (refused by the broker for good), written in that
    order."""
    conn = await asyncpg.connect(env.database_url)
    try:
        async with conn.transaction():
            owed = await enqueue(conn, "t.owed", {"n": 1}, key="order-1")
            sent = await enqueue(conn, "t.sent", {"n": 2})
            failed = await enqueue(conn, "t.refused", {"n": 3}, key="order-2")
        await conn.execute(
            "UPDATE outbox SET sent_at = now(), attempts = 1 WHERE event_id = $1", sent
        )
        await conn.execute(
            "UPDATE outbox SET failed_at = now(), attempts = 1, last_error = $2 "
            "WHERE event_id = $1",
            failed,
            _REFUSED,
        )
    finally:
        await conn.close()
    return owed, sent, failed


def _outbox(env: TestEnv, *args: str, role: str | None = None) -> Any:
    overrides = {}
    if role is not None:
        # The run-time role for the whole session, as a deployment's DSN for it would log in.
        overrides["database_url"] = f"{env.database_url}?options=-c%20role%3D{role}"
    return run_cli("consumer", "outbox", *args, env=env.env(**overrides))


def _rows(stdout: str) -> list[list[str]]:
    """The listing's rows (its header and closing lines left out), split into columns."""
    return [line.split() for line in stdout.splitlines()[1:] if line.strip()[:1].isdigit()]


async def _failed(env: TestEnv) -> list[asyncpg.Record]:
    return await fetch(
        env.database_url,
        "SELECT event_id, failed_at, last_error, attempts FROM outbox "
        "WHERE failed_at IS NOT NULL ORDER BY id",
    )


async def test_list_shows_the_rows_owed_failed_or_all_with_their_state(env: TestEnv) -> None:
    # Given a row owed, one sent and one failed
    owed, sent, failed = await _three_rows(env)

    # When the rows are listed: by default, --failed, --all newest first with a limit
    default = _outbox(env, "list")
    failed_only = _outbox(env, "list", "--failed")
    everything = _outbox(env, "list", "--all", "--newest-first", "--limit", "2")

    # Then the default lists the row owed, under a header naming every column
    assert default.returncode == 0, default.stderr
    header = default.stdout.splitlines()[0].split()
    assert header == ["id", "event_id", "type", "key", "age", "attempts", "state", "last_error"]
    ((_, event_id, kind, key, _, attempts, state),) = _rows(default.stdout)
    assert (event_id, kind, key, attempts, state) == (str(owed), "t.owed", "order-1", "0", "owed")
    # And --failed the failed row, with its error
    assert failed_only.returncode == 0, failed_only.stderr
    (row,) = _rows(failed_only.stdout)
    assert (row[1], row[6]) == (str(failed), "failed")
    assert " ".join(row[7:]) == _REFUSED
    # And --all the newest two, the limit said
    assert everything.returncode == 0, everything.stderr
    assert [(row[1], row[6]) for row in _rows(everything.stdout)] == [
        (str(failed), "failed"),
        (str(sent), "sent"),
    ]
    assert "the first 2 (--limit)" in everything.stdout


async def test_list_says_when_no_row_is_owed(env: TestEnv) -> None:
    result = _outbox(env, "list")

    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[1:] == ["no owed rows"]


async def test_show_prints_one_row_in_full(env: TestEnv) -> None:
    # Given a failed row
    _, _, failed = await _three_rows(env)

    # When it is shown, as the run-time role
    result = _outbox(env, "show", str(failed), role="consumer_app")

    # Then every field is there, the body as JSON
    assert result.returncode == 0, result.stderr
    fields = dict(
        line.split(":", 1) for line in result.stdout.splitlines() if not line.startswith(" ")
    )
    assert fields["event_id"].strip() == str(failed)
    assert fields["type"].strip() == "t.refused"
    assert fields["key"].strip() == "order-2"
    assert fields["state"].strip() == "failed"
    assert fields["caused_by"].strip() == "an application (consumer.outbox.enqueue)"
    assert fields["attempts"].strip() == "1"
    assert fields["last_error"].strip() == _REFUSED
    assert fields["sent_at"].strip() == "-"
    assert fields["failed_at"].strip() != "-"
    assert isinstance(json.loads(fields["headers"]), dict)
    body = result.stdout.split("body:\n", 1)[1]
    envelope = json.loads(body)
    assert (envelope["event_id"], envelope["type"], envelope["payload"]) == (
        str(failed),
        "t.refused",
        {"n": 3},
    )


async def test_show_and_retry_of_an_unknown_event_say_so_in_one_line_and_fail(
    env: TestEnv,
) -> None:
    # Given a failed row, and an event id no row has
    _, _, failed = await _three_rows(env)
    unknown = uuid.uuid4()

    # When it is shown, and given back beside the failed row
    shown = _outbox(env, "show", str(unknown))
    retried = _outbox(env, "retry", str(failed), str(unknown), role="consumer_app")

    # Then each says so in one line and exits 1
    assert shown.returncode == 1
    assert shown.stdout == ""
    assert shown.stderr.splitlines() == [f"error: no outbox row with event_id {unknown}"]
    assert retried.returncode == 1
    assert retried.stderr.splitlines() == [
        f"error: no outbox row with event_id {unknown}: nothing changed"
    ]
    # And nothing changed: the failed row is still failed
    assert [row["event_id"] for row in await _failed(env)] == [failed]


async def test_retry_gives_a_failed_row_back_to_the_relay_as_the_run_time_role(
    env: TestEnv,
) -> None:
    # Given a row owed, one sent and one failed
    owed, sent, failed = await _three_rows(env)

    # When a dry run looks, as the run-time role
    looked = _outbox(env, "retry", str(failed), "--dry-run", role="consumer_app")

    # Then it says what it would give back, and changes nothing
    assert looked.returncode == 0, looked.stderr
    assert looked.stdout.splitlines() == [
        f"would give back {failed}",
        "would give back 1 failed rows to the relay",
    ]
    assert [row["event_id"] for row in await _failed(env)] == [failed]

    # When the failed row and the sent one are given back
    result = _outbox(env, "retry", str(failed), str(sent), role="consumer_app")

    # Then the failed row is owed again, its error cleared and its attempts kept; the sent row is
    # left as it is
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == [
        f"gave back {failed}",
        f"not failed: {sent} (owed or sent): left as it is",
        "gave back 1 failed rows to the relay",
    ]
    assert await _failed(env) == []
    listed = _outbox(env, "list")
    assert [(row[1], row[5], row[6]) for row in _rows(listed.stdout)] == [
        (str(owed), "0", "owed"),
        (str(failed), "1", "owed"),
    ]


async def test_retry_all_failed_as_the_run_time_role(env: TestEnv) -> None:
    # Given two failed rows
    _, _, first = await _three_rows(env)
    _, _, second = await _three_rows(env)
    conn = await asyncpg.connect(env.database_url)
    try:
        # As the run-time role: sql/008 grants it the UPDATE of failed_at and last_error only
        await conn.execute("SET ROLE consumer_app")

        # When every failed row is given back, first in a dry run
        looked = await retry_failed(conn, None, dry_run=True)
        assert looked.event_ids == [first, second]
        assert len(await _failed(env)) == 2
        done = await retry_failed(conn, None, dry_run=False)

        # Then both are owed again, and a second round finds none
        assert sorted(done.event_ids) == sorted([first, second])
        assert await _failed(env) == []
        assert (await retry_failed(conn, None, dry_run=False)).event_ids == []
    finally:
        await conn.close()

    # And the command says so
    result = _outbox(env, "retry", "--all-failed", role="consumer_app")
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["gave back 0 failed rows to the relay"]


async def test_the_commands_run_as_the_role_the_database_url_names(env: TestEnv) -> None:
    # A role without the outbox's grants is refused: the tests above ran as consumer_app
    result = _outbox(env, "list", role="pg_monitor")

    assert result.returncode == 1
    assert result.stderr.startswith("error: cannot read or update the outbox: ")
    assert "permission denied" in result.stderr


async def test_a_row_given_back_is_published_by_the_relay(env: TestEnv) -> None:
    # Given a failed row of a type the topology routes, and a row owed after it
    await env.apply_topology()
    conn = await asyncpg.connect(env.database_url)
    try:
        async with conn.transaction():
            failed = await enqueue(conn, RESTOCK, {"sku": "A", "qty": 1})
            await conn.execute(
                "UPDATE outbox SET failed_at = now(), attempts = 1, last_error = $2 "
                "WHERE event_id = $1",
                failed,
                _REFUSED,
            )
        async with conn.transaction():
            after = await enqueue(conn, RESTOCK, {"sku": "B", "qty": 1})
    finally:
        await conn.close()

    # (a short poll: an UPDATE notifies nobody, so the relay finds the row given back at its poll)
    async with relay(env, poll=0.5):
        # When the relay has sent the row owed, passing the failed one by
        await wait_until(lambda: sent(env, after), what="the row owed sent")
        assert not await sent(env, failed)
        # And the failed row is given back, as the run-time role
        result = await asyncio.to_thread(_outbox, env, "retry", str(failed), role="consumer_app")
        assert result.returncode == 0, result.stderr

        # Then the relay publishes it at its next round
        await wait_until(lambda: sent(env, failed), what="the row given back sent")

    messages = await drain_queue(env.amqp_url, env.names.work)
    assert [message.message_id for message in messages] == [str(after), str(failed)]


def test_retry_needs_event_ids_or_all_failed(env: TestEnv) -> None:
    result = _outbox(env, "retry")

    assert result.returncode == 2
    assert "one of the arguments EVENT_ID --all-failed is required" in result.stderr
