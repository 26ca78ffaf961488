"""A team's image installs its handler package under the base image's constraints: the lock's
pins and the service's own version, written into the base's virtualenv by its build stage
(deploy/Dockerfile) and passed to pip by the team's Dockerfile (examples/Dockerfile, and the copy
deploy/README.md shows). A dependency of the team's package cannot move the service's."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import consumer
from tests.deploy.support import DEPLOY
from tests.deploy.test_container import (
    DOCKERFILE,
    EXAMPLE_DOCKERFILE,
    LOCK_FILE,
    _stages,
)
from tests.support import REPO

_VENV = "/opt/venv"
_CONSTRAINTS = f"{_VENV}/constraints.txt"


def _writes_constraints() -> str:
    (run,) = [
        i.arguments
        for i in _stages(DOCKERFILE)[0]
        if i.keyword == "RUN" and i.arguments.rstrip().endswith(f"> {_CONSTRAINTS}")
    ]
    return run


def _lock_pins() -> set[str]:
    pins = re.findall(r"^([a-z0-9][a-z0-9._-]*==[^\s\\]+)", (REPO / LOCK_FILE).read_text(), re.M)
    return set(pins)


def _constraints_as_the_build_writes_them(tmp_path: Path) -> list[str]:
    # The build stage's RUN, run here: its WORKDIR holds the lock; the virtualenv is this one.
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    python.chmod(0o755)
    workdir = tmp_path / "src"
    workdir.mkdir()
    (workdir / "requirements.lock").write_text((REPO / LOCK_FILE).read_text())
    script = _writes_constraints().replace(_VENV, str(venv))
    subprocess.run(["sh", "-c", script], cwd=workdir, check=True, timeout=60)
    return [line for line in (venv / "constraints.txt").read_text().splitlines() if line.strip()]


def test_the_base_image_writes_the_locks_pins_and_its_version_as_constraints(
    tmp_path: Path,
) -> None:
    lines = _constraints_as_the_build_writes_them(tmp_path)

    assert set(lines) == _lock_pins() | {f"rabbit-pg-consumer=={consumer.__version__}"}
    assert len(lines) == len(set(lines))


def test_pip_refuses_a_package_that_would_move_a_pinned_dependency(tmp_path: Path) -> None:
    # Given the base's constraints and a team package that wants another pydantic
    constraints = tmp_path / "constraints.txt"
    constraints.write_text("\n".join(_constraints_as_the_build_writes_them(tmp_path)) + "\n")
    team = tmp_path / "team"
    team.mkdir()
    (team / "pyproject.toml").write_text(
        '[project]\nname = "team-handlers"\nversion = "1.0"\n'
        'dependencies = ["pydantic<2"]\n'
        '[build-system]\nrequires = ["setuptools>=77"]\nbuild-backend = "setuptools.build_meta"\n'
        "[tool.setuptools]\npy-modules = []\n"
    )

    # When pip resolves it as the team's Dockerfile installs it
    resolved = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--dry-run",
            "--ignore-installed",
            "--no-build-isolation",
            "-c",
            str(constraints),
            str(team),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )

    # Then it refuses, naming the conflict, instead of installing another pydantic
    assert resolved.returncode != 0, resolved.stdout
    assert "pydantic" in resolved.stderr
    assert "conflict" in resolved.stderr.lower() or "ResolutionImpossible" in resolved.stderr


def test_the_teams_dockerfile_and_the_guide_install_under_the_constraints() -> None:
    (stage,) = _stages(EXAMPLE_DOCKERFILE)
    (install,) = [i.arguments for i in stage if i.keyword == "RUN"]
    assert f"-c {_CONSTRAINTS} " in install
    # deploy/README.md shows the same lines as examples/Dockerfile
    shown = " ".join((DEPLOY / "README.md").read_text().replace("\\\n", " ").split())
    assert " ".join(install.split()) in shown
