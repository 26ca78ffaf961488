"""The service and the example project as a team gets them: both wheels built, then installed into a
fresh virtualenv outside the source tree, and commands run from there with no ``PYTHONPATH``.

The wheels are built offline: no dependencies, and the running virtualenv's setuptools (the
build-system requirement, installed by the ``deploy`` extra) instead of an isolated build
environment. Each is built from a copy of its sources, never in place: setuptools' ``build/``
folder would carry files deleted since an earlier build into the wheel. The dependencies come
from the package index through pip's cache.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from tests.support import REPO, ServiceProcess, TestEnv

SERVICE_SOURCES = ("pyproject.toml", "README.md", "LICENSE", "consumer", "topology", "sql")
"""What the service's wheel is built from (deploy/Dockerfile's build stage copies the same)."""
EXAMPLE = REPO / "examples"
EXAMPLE_HANDLERS = "billing.handlers"

_NOT_SOURCES = shutil.ignore_patterns("__pycache__", "*.py[co]", "build", "dist", "*.egg-info")


def copy_sources(root: Path, names: tuple[str, ...], into: Path) -> Path:
    """``names`` (files and folders under ``root``) copied to ``into``, without build leftovers."""
    into.mkdir(parents=True)
    for name in names:
        source = root / name
        if source.is_dir():
            shutil.copytree(source, into / name, ignore=_NOT_SOURCES)
        else:
            shutil.copy(source, into / name)
    return into


def build_wheel(source: Path, wheels: Path) -> Path:
    """The wheel of the project in ``source``, built offline into ``wheels``."""
    before = set(wheels.glob("*.whl"))
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "--no-cache-dir",
            "--quiet",
            "--wheel-dir",
            str(wheels),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = set(wheels.glob("*.whl")) - before
    return wheel


@dataclass(frozen=True)
class Installed:
    """A virtualenv with the service's and the example's wheels installed, and nothing else."""

    venv: Path
    service_wheel: Path
    example_wheel: Path
    workdir: Path
    """An empty folder outside the source tree, to run the commands in."""

    def command(self, name: str) -> str:
        return str(self.venv / "bin" / name)

    def environment(self, base: dict[str, str]) -> dict[str, str]:
        """``base`` without ``PYTHONPATH``, with this virtualenv's scripts first on ``PATH``."""
        environment = {k: v for k, v in base.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
        environment["PATH"] = f"{self.venv / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"
        return environment

    def run(
        self, *argv: str, env: dict[str, str], timeout: float = 60
    ) -> subprocess.CompletedProcess[str]:
        """``argv`` (its first word one of the virtualenv's scripts) in :attr:`workdir`."""
        return subprocess.run(
            [self.command(argv[0]), *argv[1:]],
            env=self.environment(env),
            cwd=self.workdir,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )


def install_product(where: Path) -> Installed:
    """Build both wheels under ``where`` and install them into ``where/venv``."""
    wheels = where / "wheels"
    wheels.mkdir()
    service = build_wheel(copy_sources(REPO, SERVICE_SOURCES, where / "src" / "service"), wheels)
    names = [path.name for path in EXAMPLE.iterdir()]
    example_sources = tuple(sorted(set(names) - _NOT_SOURCES(str(EXAMPLE), names)))
    example = build_wheel(copy_sources(EXAMPLE, example_sources, where / "src" / "example"), wheels)
    venv = where / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    # The test run's own pip, aimed at the new virtualenv: a pip of its own would take longer to
    # install than everything else, and change nothing these tests look at.
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--python",
            str(venv / "bin" / "python"),
            "install",
            "--quiet",
            "--disable-pip-version-check",
            str(service),
            str(example),
        ],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    workdir = where / "work"
    workdir.mkdir()
    return Installed(venv, service, example, workdir)


class InstalledService(ServiceProcess):
    """``consumer run`` from the installed virtualenv, in its work folder, with no PYTHONPATH."""

    def __init__(self, test_env: TestEnv, installed: Installed, **overrides: str) -> None:
        super().__init__(test_env, "installed", **overrides)
        self.environment = installed.environment(self.environment)
        self.installed = installed

    def start(self) -> InstalledService:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [self.installed.command("consumer"), "run"],
            env=self.environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.installed.workdir,
        )
        log.close()
        return self
