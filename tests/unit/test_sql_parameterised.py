"""README "Security": every value reaches PostgreSQL as a parameter. The only statements built from
text are the two below, neither with anything a message carries: ``CREATE DATABASE`` with the name
from the settings, quoted as an identifier, and the lock timeout, an integer setting. The test kit
(``consumer.testing``, never run by the service) makes and drops its throwaway databases by their
quoted names the same way."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import consumer

SQL_START = re.compile(
    r"^\s*(SELECT|INSERT|UPDATE|DELETE|CREATE|DROP|ALTER|SET|LOCK|TRUNCATE|GRANT|REVOKE|COPY|"
    r"WITH|DO|CALL|EXECUTE|PREPARE|BEGIN|COMMIT|VACUUM|ANALYZE)\b"
)
BUILT_FROM_TEXT = {
    ("db/migrations.py", "CREATE DATABASE "),
    ("pipeline/batch.py", "SET LOCAL lock_timeout = '"),
    ("testing/database.py", "CREATE DATABASE "),
    ("testing/database.py", "DROP DATABASE IF EXISTS "),
}


def _leading_text(node: ast.expr) -> str | None:
    """The constant text a statement built at run time starts with, or None if ``node`` is not
    built (an f-string, ``%`` or ``+`` on a string, ``str.format``)."""
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return (
            first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else ""
        )
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Mod | ast.Add):
        left = node.left
        if isinstance(left, ast.Constant) and isinstance(left.value, str):
            return left.value
        return _leading_text(left)
    if (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == "format"
        and isinstance(node.func.value, ast.Constant)
        and isinstance(node.func.value.value, str)
    ):
        return node.func.value.value
    return None


CONSTANT = re.compile(r"^_?[A-Z][A-Z0-9_]*$")


def _of_constants(node: ast.expr) -> bool:
    """Built only from literals and module constants (``_UPPER_CASE``: other SQL text)."""
    parts = [
        child
        for child in ast.walk(node)
        if isinstance(child, ast.Name | ast.Call | ast.Attribute | ast.Subscript)
    ]
    return all(isinstance(part, ast.Name) and CONSTANT.match(part.id) for part in parts)


def built_statements(root: Path) -> set[tuple[str, str]]:
    """Every statement-like string in ``root``'s modules that is put together at run time from
    anything but literals and SQL constants."""
    found = set()
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.expr):
                continue
            text = _leading_text(node)
            if text is not None and SQL_START.match(text) and not _of_constants(node):
                found.add((path.relative_to(root).as_posix(), text))
    return found


def test_no_statement_is_built_from_text_but_the_two_without_message_content() -> None:
    assert built_statements(Path(consumer.__file__).parent) == BUILT_FROM_TEXT


def test_the_scan_sees_each_way_of_building_a_statement(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        'a = f"SELECT {x}"\nb = "DELETE FROM t WHERE id = %s" % y\n'
        'c = "UPDATE t SET v = " + z\nd = "DROP TABLE {}".format(w)\ne = "SELECT $1"\n'
        'f = f"SELECT {_COLUMNS} FROM t"\ng = f"SELECT * FROM {self.table}"\n'
    )
    assert {text for _, text in built_statements(tmp_path)} == {
        "SELECT ",
        "DELETE FROM t WHERE id = %s",
        "UPDATE t SET v = ",
        "DROP TABLE {}",
        "SELECT * FROM ",
    }
