"""What the README and the documentation pages say that the code can check: the receipts' key
as sql/ makes it, and every ``consumer ...`` command line of their code blocks (each one parses
with the real command's parser, and its command's ``--help`` runs)."""

from __future__ import annotations

import argparse
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from consumer.cli.main import _parser
from tests.support import REPO

PAGES = sorted([REPO / "README.md", *(REPO / "docs").rglob("*.md")])
_FENCE = re.compile(r"^```[^\n]*\n(.*?)^```", re.M | re.S)


def _receipts_key_in_sql() -> str:
    """The primary key of the last ``CREATE TABLE receipts`` of the service's migrations."""
    key = ""
    for migration in sorted((REPO / "sql").glob("*.sql")):
        for table in re.findall(r"CREATE TABLE receipts \((.*?)\n\)", migration.read_text(), re.S):
            (key,) = re.findall(r"PRIMARY KEY \(([^)]*)\)", table)
    return key


def test_the_docs_give_the_receipts_key_sql_makes() -> None:
    key = _receipts_key_in_sql()
    assert key == "consumer, event_id, occurred_at"
    text = " ".join(p.read_text() for p in PAGES)
    shown = re.findall(r"`receipts\([^`]*primary key\s+\(([^)]*)\)", text, re.S)
    assert shown, "the docs describe the receipts table with its primary key"
    assert {" ".join(s.split()) for s in shown} == {key}


def _command_lines() -> list[tuple[str, list[str]]]:
    """Every ``consumer ...`` line of every code block, as (where, arguments after consumer)."""
    found: list[tuple[str, list[str]]] = []
    for page in PAGES:
        text = page.read_text()
        for block in _FENCE.findall(text):
            joined = block.replace("\\\n", " ")
            for line in joined.splitlines():
                command = line.split(" #", 1)[0].strip().rstrip("&").strip()
                match = re.search(r"(?:^|[\s;|(])consumer\s+(.*)$", command)
                if match is None or command.startswith(("#", "-", "from ", "import ")):
                    continue
                rest = match.group(1).split(" | ")[0].split(" && ")[0].strip()
                # A shell redirection (> file, 2> file, < file) is the shell's, not the command's.
                rest = re.sub(r"\s*\d?[<>]{1,2}\s*\S+", "", rest).strip()
                # A usage line's optional parts ([--limit N]) are left out: the rest must parse.
                rest = re.sub(r"\s*\[[^\]]*\]", "", rest).strip()
                try:
                    arguments = shlex.split(rest)
                except ValueError:
                    continue
                if arguments and not arguments[0].startswith("-") and "." in arguments[0]:
                    continue  # a Python name such as `consumer.handlers`, not the command
                found.append((f"{page.relative_to(REPO)}: consumer {rest}", arguments))
    return found


COMMANDS = _command_lines()


def test_the_docs_show_commands() -> None:
    shown = {arguments[0] for _, arguments in COMMANDS if arguments}
    assert {"run", "migrate", "publish", "dlq", "topology", "events"} <= shown


def _subcommand(arguments: list[str]) -> list[str]:
    """The leading words of ``arguments`` that name a (sub)command of the parser."""
    parser: argparse.ArgumentParser = _parser()
    path: list[str] = []
    for word in arguments:
        actions = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        if not actions or word not in actions[0].choices:
            break
        parser = actions[0].choices[word]
        path.append(word)
    return path


@pytest.mark.parametrize(("where", "arguments"), COMMANDS, ids=[w for w, _ in COMMANDS])
def test_each_command_line_shown_parses(where: str, arguments: list[str]) -> None:
    # Placeholders in capitals (EVENT_ID, JSON) stand for a value: a UUID where one is needed.
    values = [
        "00000000-0000-4000-8000-000000000001" if re.fullmatch(r"[A-Z_]+(\.\.\.)?", a) else a
        for a in arguments
    ]
    code: object = 0
    try:
        _parser().parse_args(values)
    except SystemExit as stop:  # --version and --help end here, with 0
        code = stop.code
    assert code == 0, f"{where}: the command's parser refuses it"


def test_each_command_shown_answers_help() -> None:
    paths = sorted({tuple(_subcommand(arguments)) for _, arguments in COMMANDS})
    for path in paths:
        result = subprocess.run(
            [sys.executable, "-m", "consumer", *path, "--help"],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=60,
            check=False,
        )
        assert result.returncode == 0, (path, result.stderr)
        assert "usage: consumer" in result.stdout


def test_the_pages_are_found() -> None:
    assert Path(REPO / "docs" / "index.md") in PAGES
