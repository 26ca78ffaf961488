"""Every deploy file runs the installed package: none points ``PYTHONPATH`` at a source tree, and
each command is the package's console script, ``consumer`` (compose, Kubernetes, systemd and the
image are checked command by command in their own tests)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.deploy.support import DEPLOY
from tests.support import REPO

_DOCS = (".md",)
# python -m consumer, as a shell line or as a JSON/YAML list (["python", "-m", "topology", ...]).
_PYTHON_M = re.compile(r"python[0-9.]*\"?,?\s*\"?-m\"?,?\s*\"?(consumer|topology)")


def _deploy_files() -> dict[Path, str]:
    files = [*DEPLOY.rglob("*"), *(REPO / "examples").rglob("*"), REPO / ".dockerignore"]
    return {
        path: path.read_text()
        for path in files
        if path.is_file() and path.suffix not in _DOCS and "__pycache__" not in path.parts
    }


def test_no_deploy_file_sets_pythonpath() -> None:
    setting = [path for path, text in _deploy_files().items() if "PYTHONPATH" in text]

    assert setting == []


def test_no_deploy_file_runs_python_m() -> None:
    # `python -m consumer` still works, but a deploy file that needs it would be running code that
    # the console script does not find: the package was not installed.
    running = [path for path, text in _deploy_files().items() if _PYTHON_M.search(text)]

    assert running == []
