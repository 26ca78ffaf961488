"""``make dist`` builds the wheel in a build environment of its own (setuptools at the lock's
pin), never the development virtualenv: a 100 KB wheel must not cost the 420 MB of ``.venv``."""

from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.support import REPO
from tests.wheels import SERVICE_SOURCES, copy_sources


def _make(folder: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args],
        cwd=folder,
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )


def test_make_dist_does_not_set_up_the_development_virtualenv() -> None:
    # Given a checkout with no development virtualenv at all
    # When make says what `dist` would run
    planned = _make(REPO, "-n", "dist", "VENV=/nonexistent/dev-venv")

    # Then nothing of it installs the package with its development extra, or touches that venv
    assert planned.returncode == 0, planned.stderr
    assert "/nonexistent/dev-venv" not in planned.stdout
    assert "[dev" not in planned.stdout


def test_make_dist_builds_the_wheel_from_a_setuptools_only_environment(tmp_path: Path) -> None:
    # Given the service's sources, its Makefile and its lock, in a folder of their own
    source = copy_sources(REPO, (*SERVICE_SOURCES, "Makefile"), tmp_path / "src")
    (source / "deploy").mkdir()
    shutil.copy(REPO / "deploy" / "requirements.lock", source / "deploy")

    # When `make dist` runs there
    built = _make(source, "dist", f"PYTHON={sys.base_prefix}/bin/python3")

    # Then the wheel is there, the build environment has setuptools and pip only, and no
    # development virtualenv was made
    assert built.returncode == 0, built.stdout + built.stderr
    (wheel,) = (source / "dist").glob("rabbit_pg_consumer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "consumer/sql/001_receipts.sql" in archive.namelist()
    assert not (source / ".venv").exists()
    listed = subprocess.run(
        [str(source / ".venv-dist" / "bin" / "python"), "-m", "pip", "list", "--format=freeze"],
        capture_output=True,
        text=True,
        check=True,
    )
    installed = {line.split("==")[0].lower() for line in listed.stdout.split()}
    assert installed <= {"pip", "setuptools", "wheel"}, installed
