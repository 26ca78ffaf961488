"""The settings table of docs/operations/settings.md, made from the settings' own definitions
(``consumer/config/settings.py``): a row per field, its variable, its default and the docstring
under it. ``tests/unit/test_settings_table.py`` fails when the page's copy differs (a setting
added, removed, its default or its docstring changed) or a setting has no docstring.

    python -m tests.settings_table           # prints the table
    python -m tests.settings_table --write   # writes it into the page, between its markers
"""

from __future__ import annotations

import ast
import sys
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import SecretStr

from consumer.config.settings import ENV_PREFIX, Settings
from tests.marked_section import between, write_between
from topology.durations import format_duration

REPO = Path(__file__).resolve().parents[1]
SOURCE = REPO / "consumer" / "config" / "settings.py"
PAGE = REPO / "docs" / "operations" / "settings.md"
BEGIN = (
    "<!-- settings table: made by `python -m tests.settings_table --write`; checked by a test -->"
)
END = "<!-- end of the settings table -->"


def docstrings(source: Path = SOURCE) -> dict[str, str]:
    """Each field of ``Settings`` and the docstring under it (the string right after it)."""
    tree = ast.parse(source.read_text())
    (cls,) = [n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Settings"]
    found: dict[str, str] = {}
    for node, after in zip(cls.body, [*cls.body[1:], None], strict=True):
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        if (
            isinstance(after, ast.Expr)
            and isinstance(after.value, ast.Constant)
            and isinstance(after.value.value, str)
        ):
            found[node.target.id] = " ".join(after.value.value.split())
    return found


def _default(value: Any) -> str:
    if value is None:
        return "unset"
    if isinstance(value, SecretStr):
        value = value.get_secret_value()
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, timedelta):
        return format_duration(value)
    if isinstance(value, tuple):
        return ",".join(_default(item) for item in value)
    return str(value)


def _markdown(docstring: str) -> str:
    # Sphinx roles to code spans; pipes would end the cell.
    text = docstring.replace("``", "`")
    for role in (":func:", ":mod:", ":class:", ":meth:"):
        text = text.replace(role, "")
    return text.replace("|", "\\|")


def table() -> str:
    """The table, from the settings as defined now."""
    described = docstrings()
    lines = ["| variable | default | meaning |", "|---|---|---|"]
    for name, field in Settings.model_fields.items():
        variable = f"{ENV_PREFIX}{name}".upper()
        meaning = _markdown(described.get(name, "(no docstring)"))
        lines.append(f"| `{variable}` | `{_default(field.default)}` | {meaning} |")
    return "\n".join(lines) + "\n"


def on_page(text: str) -> str:
    """The table as the page has it (between the markers)."""
    return between(text, BEGIN, END)


def write(page: Path = PAGE) -> None:
    write_between(page, BEGIN, END, table())


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    else:
        sys.stdout.write(table())
