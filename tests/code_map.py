"""The code map (docs/internals/code-map.md), made from the tree: a table per wing, a row per
module, each module's line the first sentence of its docstring. ``tests/unit/test_code_map.py``
fails when the page's copy differs from what the tree gives (a module added, moved, removed,
or its docstring changed).

    python -m tests.code_map           # prints the map
    python -m tests.code_map --write   # writes it into the page, between its markers
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

from tests.marked_section import between, write_between

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "docs" / "internals" / "code-map.md"
BEGIN = "<!-- code map: made by `python -m tests.code_map --write`; checked by a test -->"
END = "<!-- end of the code map -->"

# The wings from the bottom layer up (pyproject's [tool.importlinter]), then the reference
# handlers and the broker plan beside them.
FOLDERS = (
    "consumer",
    "consumer/config",
    "consumer/amqp",
    "consumer/db",
    "consumer/pipeline",
    "consumer/observe",
    "consumer/service",
    "consumer/cli",
    "consumer/cli/dlq",
    "consumer/cli/topology",
    "consumer/testing",
    "consumer/handlers",
    "topology",
)
_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")


def first_sentence(path: Path) -> str:
    """The first sentence of ``path``'s docstring, in Markdown."""
    docstring = ast.get_docstring(ast.parse(path.read_text())) or ""
    paragraph = " ".join(docstring.split("\n\n")[0].split())
    found = re.match(r"(.+?\.)(\s|$)", paragraph)
    sentence = found.group(1) if found else paragraph
    sentence = _ROLE.sub(r"`\1`", sentence).replace("``", "`")
    return sentence.replace("|", "\\|")


def code_map(root: Path = REPO) -> str:
    """The map of the tree under ``root``."""
    lines: list[str] = []
    for folder in FOLDERS:
        package = root / folder
        modules = sorted(p for p in package.glob("*.py") if p.name != "__init__.py")
        init = package / "__init__.py"
        about = first_sentence(init) if init.exists() else ""
        lines.append(f"**`{folder}/`** {about}".rstrip())
        lines.append("")
        lines.append("| module | what it is |")
        lines.append("|---|---|")
        lines.extend(f"| `{module.stem}` | {first_sentence(module)} |" for module in modules)
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def on_page(text: str) -> str:
    """The map as the page has it (between the markers)."""
    return between(text, BEGIN, END)


def write(page: Path = PAGE) -> None:
    write_between(page, BEGIN, END, code_map())


if __name__ == "__main__":
    if "--write" in sys.argv[1:]:
        write()
    else:
        sys.stdout.write(code_map())
