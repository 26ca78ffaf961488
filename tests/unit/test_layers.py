"""The layers of pyproject's ``[tool.importlinter]`` (``make lint`` runs them): they hold, and
the checker sees every import, those made inside a function or only for type checking included,
so no circle can hide behind one."""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import grimp

from tests.support import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")


def _lint_imports(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(cwd)}
    return subprocess.run(
        [str(LINT_IMPORTS), "--no-cache", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )


def test_the_contracts_hold() -> None:
    run = _lint_imports(REPO)

    assert run.returncode == 0, run.stdout + run.stderr
    assert "0 broken" in run.stdout


def test_the_checker_counts_type_only_and_lazy_imports() -> None:
    options = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]
    graph = grimp.build_graph(
        "consumer", exclude_type_checking_imports=options["exclude_type_checking_imports"]
    )

    # Under `if TYPE_CHECKING:` only.
    assert graph.direct_import_exists(
        importer="consumer.pipeline.tracing", imported="consumer.amqp.delivery"
    )
    # Inside a function: OpenTelemetry is loaded only when tracing is asked for.
    assert graph.direct_import_exists(
        importer="consumer.observe.tracing_setup", imported="consumer.observe.otel"
    )


def test_a_circle_of_a_lazy_and_a_type_only_import_breaks_the_contract(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("def f() -> None:\n    from pkg import b  # noqa: F401\n")
    (package / "b.py").write_text(
        "from typing import TYPE_CHECKING\n\nif TYPE_CHECKING:\n    from pkg import a\n"
    )
    (tmp_path / ".importlinter").write_text(
        "[importlinter]\nroot_package = pkg\nexclude_type_checking_imports = false\n\n"
        "[importlinter:contract:circles]\nname = No circle\ntype = acyclic_siblings\n"
        "ancestors =\n    pkg\n"
    )

    run = _lint_imports(tmp_path)

    assert run.returncode == 1, run.stdout + run.stderr
    assert "No circle BROKEN" in run.stdout
