"""``consumer topology migrate`` between a service without a table and one with a table, as the
command reads it: ``--from-queues-file none``, the way back, and the combinations it refuses with
one line (dry runs: no broker)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from consumer.cli.main import main

TABLE = """
[queues.stock]
types = ["inventory.reserve", "inventory.restock"]
retry_delays = ["2s"]

[queues.notify]
types = ["notification.requested"]
"""


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("CONSUMER_"):
            monkeypatch.delenv(key)
    monkeypatch.setenv("CONSUMER_RETRY_DELAYS", "1s,5s")


@pytest.fixture
def table(tmp_path: Path) -> Path:
    path = tmp_path / "queues.toml"
    path.write_text(TABLE)
    return path


def _migrate(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    try:
        code = main(["topology", "migrate", *argv])
    except SystemExit as stop:
        code = int(stop.code or 0)
    out, err = capsys.readouterr()
    return code, out, err


def test_from_none_to_a_table_moves_every_type_out_of_the_one_queue(
    table: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONSUMER_QUEUES_FILE", str(table))

    code, out, err = _migrate(capsys, "--from-queues-file", "none", "--dry-run")

    assert code == 0, err
    lines = out.splitlines()
    assert lines[0] == (
        "moves inventory.reserve: from the service without a table to queue stock "
        "(consumer.stock.work); what consumer.work holds is moved"
    )
    assert (
        "move the messages of consumer.work by event type: notification.requested to exchange "
        "consumer.notify.redeliver, the rest to exchange consumer.stock.redeliver"
    ) in out
    assert lines[-1].endswith(". delete queue consumer.work once empty and without consumers")


def test_from_none_the_settings_flags_give_the_old_service_s_settings(
    table: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONSUMER_QUEUES_FILE", str(table))

    code, out, err = _migrate(
        capsys, "--from-queues-file", "none", "--from-retry-delays", "3s", "--dry-run"
    )

    assert code == 0, err
    assert "move the messages of consumer.retry.3s by event type" in out
    assert "consumer.retry.1s" not in out


def test_back_to_no_table_every_queue_moves_into_the_one_queue(
    table: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, out, err = _migrate(capsys, "--from-queues-file", str(table), "--dry-run")

    assert code == 0, err
    assert out.splitlines()[0] == (
        "moves inventory.reserve: from queue stock to the service without a table "
        "(consumer.work); what consumer.stock.work holds is moved"
    )
    assert "move the messages of consumer.stock.work to exchange consumer.redeliver" in out
    assert "bind events -> consumer.work with routing key 'notification.requested'" in out


def test_the_rollback_of_none_to_a_table_is_the_way_back(
    table: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _, back, _ = _migrate(capsys, "--from-queues-file", str(table), "--dry-run")
    monkeypatch.setenv("CONSUMER_QUEUES_FILE", str(table))

    code, rollback, err = _migrate(capsys, "--from-queues-file", "none", "--rollback", "--dry-run")

    assert code == 0, err
    assert rollback == back


def test_none_without_a_table_now_is_refused_in_one_line(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = _migrate(capsys, "--from-queues-file", "none", "--dry-run")

    assert code == 2
    assert out == ""
    assert err == (
        "error: --from-queues-file none: CONSUMER_QUEUES_FILE is unset too, so the install has "
        "no queue table before or after: without --from-queues-file, the --from-* flags migrate "
        "its settings\n"
    )


def test_the_settings_flags_going_back_to_no_table_are_refused_in_one_line(
    table: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _migrate(
        capsys, "--from-queues-file", str(table), "--from-delivery-limit", "5", "--dry-run"
    )

    assert code == 2
    assert err.startswith("error: --from-delivery-limit: with --from-queues-file OLD.toml")
    assert err.count("\n") == 1


def test_a_table_now_and_no_old_table_named_says_none_is_an_answer(
    table: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONSUMER_QUEUES_FILE", str(table))

    code, _, err = _migrate(capsys, "--dry-run")

    assert code == 2
    assert "(--from-queues-file OLD.toml, or none if it had none)" in err


def test_an_unreadable_old_table_going_back_is_refused_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = _migrate(capsys, "--from-queues-file", str(tmp_path / "nope.toml"))

    assert code == 2
    assert err.startswith("error: --from-queues-file: invalid queue table")
    assert err.count("\n") == 1


def test_a_settings_flag_with_a_table_now_and_no_old_one_named_says_none_is_an_answer(
    table: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    # The flags are how an install without a table gives its old settings: the answer is
    # --from-queues-file none, not an old table it never had.
    monkeypatch.setenv("CONSUMER_QUEUES_FILE", str(table))

    code, _, err = _migrate(capsys, "--from-retry-delays", "1s", "--dry-run")

    assert code == 2
    assert err.startswith("error: --from-retry-delays: ")
    assert "--from-queues-file none" in err
    assert err.count("\n") == 1


def test_a_settings_flag_with_both_tables_named_says_to_write_it_in_the_old_one(
    table: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONSUMER_QUEUES_FILE", str(table))

    code, _, err = _migrate(
        capsys, "--from-queues-file", str(table), "--from-retry-delays", "1s", "--dry-run"
    )

    assert code == 2
    assert err.startswith("error: --from-retry-delays: with --from-queues-file OLD.toml")
    assert "write them in it" in err
    assert err.count("\n") == 1
