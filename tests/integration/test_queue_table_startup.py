"""An unusable queue table (CONSUMER_QUEUES_FILE) stops every command that reads it with one line
naming the file, the queue and the key, exit 2, before any connection."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.support import REFERENCE_HANDLERS, REFERENCE_TABLE, REPO, run_cli

GOOD = REFERENCE_TABLE


def env_for(path: Path) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")}
    return {
        **base,
        "CONSUMER_NAME": "queue-table-startup",
        # Nothing listens there: the table must be refused before any connection is tried.
        "CONSUMER_AMQP_URL": "amqp://guest:guest@127.0.0.1:1/",
        "CONSUMER_HANDLERS": REFERENCE_HANDLERS,
        "CONSUMER_QUEUES_FILE": str(path),
        "PYTHONPATH": str(REPO),
    }


@pytest.mark.parametrize("command", [("consumer", "run"), ("topology", "apply", "--dry-run")])
@pytest.mark.parametrize(
    ("table", "expected"),
    [
        (GOOD + "prefech = 1\n", "queue notify: prefech: unknown key (did you mean prefetch?)"),
        (GOOD.replace('"notification.requested"', '"notification.requested", "x.y"'), "x.y"),
        (GOOD.replace(', "inventory.reserve"', ""), "no queue takes 'inventory.reserve'"),
        (GOOD + 'types = ["inventory.restock"]\n'.join(["[queues.again]\n", ""]), "also in"),
        (GOOD + "prefetch = 0\n", "queue notify: prefetch: Input should be greater than or"),
    ],
    ids=["unknown-key", "type-without-handler", "handler-in-no-queue", "type-twice", "bad-value"],
)
def test_an_unusable_table_stops_start_up_with_one_line(
    tmp_path: Path, command: tuple[str, ...], table: str, expected: str
) -> None:
    path = tmp_path / "queues.toml"
    path.write_text(table)

    result = run_cli(command[0], *command[1:], env=env_for(path))

    assert result.returncode == 2, (result.stdout, result.stderr)
    assert result.stdout == ""
    assert "Traceback" not in result.stderr
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"error: invalid queue table {path}: ")
    assert expected in line


def test_the_queues_file_setting_names_a_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "missing.toml"

    result = run_cli("consumer", "run", env=env_for(path))

    assert result.returncode == 2
    (line,) = result.stderr.splitlines()
    assert line == f"error: invalid queue table {path}: cannot read it: No such file or directory"
