"""deploy/requirements.lock, the image's dependencies (`make lock`): consistent with pyproject.toml,
and installable the way deploy/Dockerfile installs it.

The lock is read as pip reads it: ``name==version`` lines, each with its ``--hash`` options. Every
runtime dependency of pyproject.toml (markers evaluated for the image: CPython 3.11 on Linux) and
the build backend (the ``image-build`` group, which must be the build-system's requirement) is
pinned within pyproject's range, and so is everything they need in turn (read from the installed
distributions' metadata: `make install` installs the virtualenv within the lock's pins). The
install test then does what the image's build stage does, into a fresh virtualenv: the lock with
``--require-hashes`` and wheels only (from the package index, through pip's cache), then the
service's wheel with ``--no-deps``, and ``pip check``.
"""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from tests.deploy.support import DEPLOY
from tests.support import REPO
from tests.wheels import Installed

LOCK = DEPLOY / "requirements.lock"
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())
# The image's interpreter and platform (deploy/Dockerfile: python:3.11-slim, Linux).
IMAGE_ENVIRONMENT: dict[str, str] = {
    **{str(key): str(value) for key, value in default_environment().items()},
    "python_version": "3.11",
    "python_full_version": "3.11.0",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "os_name": "posix",
}
_PIN = re.compile(r"^(?P<name>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^\s;\\]+)\s*\\?$")
_HASH = re.compile(r"^--hash=sha256:[0-9a-f]{64}$")


@dataclass(frozen=True, slots=True)
class Pin:
    version: str
    hashes: tuple[str, ...]


def _pins() -> dict[str, Pin]:
    """``canonical name -> Pin``; anything in the file that is no pin, hash or comment fails."""
    pins: dict[str, Pin] = {}
    current: str | None = None
    hashes: list[str] = []
    version = ""

    def close() -> None:
        if current is not None:
            pins[current] = Pin(version, tuple(hashes))

    for number, raw in enumerate(LOCK.read_text().splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        pin = _PIN.match(line)
        if pin is not None:
            close()
            current, version, hashes = canonicalize_name(pin["name"]), pin["version"], []
            assert current not in pins, f"line {number}: {current} pinned twice"
            continue
        option = line.removesuffix("\\").strip()
        assert current is not None, f"line {number}: {raw!r} before any pin"
        assert _HASH.match(option), f"line {number}: not a sha256 hash: {raw!r}"
        hashes.append(option)
    close()
    return pins


def _wanted(requirements: list[str]) -> list[Requirement]:
    """The requirements that apply to the image (markers evaluated for it, no extras)."""
    parsed = [Requirement(text) for text in requirements]
    return [r for r in parsed if r.marker is None or r.marker.evaluate(IMAGE_ENVIRONMENT)]


def _runtime() -> list[Requirement]:
    return _wanted(PYPROJECT["project"]["dependencies"])


def _build_backend() -> list[Requirement]:
    return _wanted(PYPROJECT["dependency-groups"]["image-build"])


def test_every_line_is_an_exact_pin_with_sha256_hashes() -> None:
    pins = _pins()

    assert pins, "nothing pinned"
    for name, pin in pins.items():
        assert pin.hashes, f"{name} has no hash"
    assert LOCK.read_text().splitlines()[1].strip() == "#    make lock", "regenerate with make lock"


def test_every_runtime_dependency_is_pinned_within_pyprojects_range() -> None:
    pins = _pins()

    for requirement in _runtime():
        name = canonicalize_name(requirement.name)
        assert name in pins, f"{requirement} is not in the lock"
        assert requirement.specifier.contains(pins[name].version, prereleases=True), (
            f"{name}=={pins[name].version} is outside pyproject's {requirement}"
        )


def test_the_build_backend_is_the_build_systems_and_is_pinned() -> None:
    pins = _pins()
    build_system = [Requirement(text) for text in PYPROJECT["build-system"]["requires"]]

    assert [str(r) for r in _build_backend()] == [str(r) for r in build_system]
    for requirement in build_system:
        name = canonicalize_name(requirement.name)
        assert requirement.specifier.contains(pins[name].version), requirement


def _closure(roots: list[Requirement]) -> dict[str, str]:
    """Every distribution the roots need, by the installed metadata: ``name -> version``."""
    found: dict[str, str] = {}
    pending = [(r, frozenset[str]()) for r in roots]
    while pending:
        requirement, extras = pending.pop()
        name = canonicalize_name(requirement.name)
        if name in found:
            continue
        distribution = metadata.distribution(name)
        found[name] = distribution.version
        for text in distribution.requires or []:
            child = Requirement(text)
            applies = child.marker is None or any(
                child.marker.evaluate({**IMAGE_ENVIRONMENT, "extra": extra})
                for extra in (extras or {""})
            )
            if applies:
                pending.append((child, frozenset(child.extras)))
    return found


def test_the_lock_holds_exactly_what_the_dependencies_need() -> None:
    pins = _pins()

    needed = _closure([*_runtime(), *_build_backend()])

    # Nothing missing, nothing extra
    assert set(needed) == set(pins), (
        f"missing: {sorted(set(needed) - set(pins))}, extra: {sorted(set(pins) - set(needed))}"
    )
    # and the virtualenv the tests run in has the locked versions (make install follows the lock)
    different = {name: (needed[name], pins[name].version) for name in needed}
    assert {k: v for k, v in different.items() if v[0] != v[1]} == {}, "run make install"


def test_the_lock_installs_as_the_image_installs_it(
    tmp_path: Path, installed_product: Installed
) -> None:
    # Given a fresh virtualenv (the image's /opt/venv)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)

    def pip(*arguments: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), *arguments],
            capture_output=True,
            text=True,
            timeout=600,
            check=False,
        )

    # When the lock is installed as the Dockerfile does, then the service's wheel alone
    locked = pip("install", "--quiet", "--require-hashes", "--only-binary=:all:", "-r", str(LOCK))
    package = pip("install", "--quiet", "--no-deps", str(installed_product.service_wheel))

    # Then every hash matched, and the package finds every dependency it declares, in range
    assert locked.returncode == 0, locked.stdout + locked.stderr
    assert package.returncode == 0, package.stdout + package.stderr
    checked = pip("check")
    assert checked.returncode == 0, checked.stdout + checked.stderr
    version = subprocess.run(
        [str(venv / "bin" / "consumer"), "--version"], capture_output=True, text=True, check=False
    )
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("rabbit-pg-consumer ")
