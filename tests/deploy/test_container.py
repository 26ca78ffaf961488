"""deploy/Dockerfile and .dockerignore, and the team's image that extends it (examples/Dockerfile).

No Docker engine runs where these tests run, so no image is built here. What is checked: hadolint
lints both Dockerfiles; the final stage's settings are asserted (it holds the virtualenv and
nothing from a source tree, no PYTHONPATH); .dockerignore is read with Docker's matching rules
(re-implemented below) to see that every COPY source reaches the build and nothing else does; the
build stage's COPY lines are carried out in a folder and the package's wheel is built from it, and
that wheel is the one tests/install installs (the same files, the same hashes); so the image's
commands (migrate, topology apply, run) and its HEALTHCHECK command run from that installed
virtualenv against the real broker and database, with the image's ENV. Not covered: the base
image, installing the dependencies into /opt/venv inside it, and running as uid 10001.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import asyncpg
import pytest

import consumer
from consumer.config.settings import DEFAULT_HANDLER_MODULES
from tests.deploy.support import DEPLOY, assert_clean, run_tool
from tests.servers import free_port
from tests.support import REPO, TestEnv, fetchval
from tests.wheels import (
    EXAMPLE,
    EXAMPLE_HANDLERS,
    SERVICE_SOURCES,
    Installed,
    InstalledService,
    build_wheel,
)

DOCKERFILE = DEPLOY / "Dockerfile"
LOCK_FILE = "deploy/requirements.lock"


@dataclass(frozen=True)
class Instruction:
    keyword: str
    arguments: str


def _instructions(text: str) -> list[Instruction]:
    logical: list[str] = []
    pending = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        logical.append(pending + line)
        pending = ""
    assert not pending, "the Dockerfile ends inside a continued line"
    return [
        Instruction(keyword.upper(), arguments.strip())
        for keyword, _, arguments in (line.partition(" ") for line in logical)
    ]


def _stages(dockerfile: Path = DOCKERFILE) -> list[list[Instruction]]:
    """Each stage's instructions, its FROM first (global ARGs before the first FROM left out)."""
    stages: list[list[Instruction]] = []
    for instruction in _instructions(dockerfile.read_text()):
        if instruction.keyword == "FROM":
            stages.append([])
        if stages:
            stages[-1].append(instruction)
    return stages


_DIGEST = re.compile(r"@sha256:[0-9a-f]{64}$")
_VARIABLE = re.compile(r"^\$\{?([A-Za-z_][A-Za-z0-9_]*)\}?$")


def _bases(text: str) -> list[tuple[str, str | None]]:
    """Each FROM's image, with a global ARG's default put in for a variable, and the ARG's name
    (None for an image named in the FROM line itself)."""
    defaults: dict[str, str] = {}
    bases: list[tuple[str, str | None]] = []
    for instruction in _instructions(text):
        if instruction.keyword == "ARG" and not bases:
            name, _, default = instruction.arguments.partition("=")
            defaults[name.strip()] = default.strip()
        elif instruction.keyword == "FROM":
            image = instruction.arguments.split()[0]
            variable = _VARIABLE.match(image)
            if variable is None:
                bases.append((image, None))
            else:
                bases.append((defaults.get(variable.group(1), ""), variable.group(1)))
    return bases


def _unpinned(text: str) -> list[str]:
    """The FROM images in ``text`` that a build would pull by tag: not pinned by digest, not an
    earlier stage, and not this repository's own image taken as a build argument (no registry
    holds it until a team pushes it; then the team passes the digest: examples/Dockerfile)."""
    own = f"rabbit-pg-consumer:{consumer.__version__}"
    stage_names: set[str] = set()
    unpinned = []
    for instruction in _instructions(text):
        if instruction.keyword == "FROM":
            words = instruction.arguments.split()
            if len(words) == 3 and words[1].upper() == "AS":
                stage_names.add(words[2])
    for image, argument in _bases(text):
        if _DIGEST.search(image) or image in stage_names or (argument and image == own):
            continue
        unpinned.append(image)
    return unpinned


def _final_stage() -> list[Instruction]:
    return _stages()[-1]


def _only(stage: list[Instruction], keyword: str) -> str:
    found = [i.arguments for i in stage if i.keyword == keyword]
    assert len(found) == 1, f"expected one {keyword} in the final stage, found {found}"
    return found[0]


def _environment(stage: list[Instruction]) -> dict[str, str]:
    values: dict[str, str] = {}
    for instruction in stage:
        if instruction.keyword == "ENV":
            for assignment in shlex.split(instruction.arguments):
                key, _, value = assignment.partition("=")
                values[key] = value
    return values


def _copies(stage: list[Instruction]) -> list[tuple[list[str], str]]:
    """``(sources, destination)`` of each COPY from the build context (not ``--from``)."""
    copies = []
    for instruction in stage:
        if instruction.keyword == "COPY" and not instruction.arguments.startswith("--from"):
            *sources, destination = instruction.arguments.split()
            copies.append((sources, destination))
    return copies


# -- .dockerignore, as Docker reads it -----------------------------------------------------------


def _pattern_regex(pattern: str) -> re.Pattern[str]:
    """Go's filepath.Match plus ``**``, as moby's patternmatcher compiles a .dockerignore line."""
    out = ""
    index = 0
    while index < len(pattern):
        char = pattern[index]
        if pattern.startswith("**", index):
            index += 2
            if pattern.startswith("/", index):
                index += 1
                out += "(.*/)?"
            else:
                out += ".*"
            continue
        if char == "*":
            out += "[^/]*"
        elif char == "?":
            out += "[^/]"
        else:
            out += re.escape(char)
        index += 1
    return re.compile(f"^{out}$")


def _dockerignore(path: Path = REPO / ".dockerignore") -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        negated = line.startswith("!")
        pattern = line.removeprefix("!").strip().strip("/")
        rules.append((negated, _pattern_regex(pattern)))
    return rules


def _excluded(path: str, rules: list[tuple[bool, re.Pattern[str]]]) -> bool:
    """Docker's rule: the last pattern matching the path or one of its parent folders wins."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: n + 1]) for n in range(len(parts))]
    excluded = False
    for negated, regex in rules:
        if any(regex.match(prefix) for prefix in prefixes):
            excluded = not negated
    return excluded


def _context_files(source: str) -> list[str]:
    root = REPO / source
    paths = [root] if root.is_file() else sorted(p for p in root.rglob("*") if p.is_file())
    return [p.relative_to(REPO).as_posix() for p in paths]


# -- the checks ----------------------------------------------------------------------------------


def test_hadolint_passes() -> None:
    result = run_tool("hadolint", "--failure-threshold", "style", str(DOCKERFILE))

    assert_clean(result)


def test_every_stage_starts_from_the_slim_python_311_image_pinned_by_one_digest() -> None:
    bases = [stage[0].arguments.split()[0] for stage in _stages()]

    assert len(bases) >= 2, "a build stage and a runtime stage"
    (base,) = set(bases)
    tag, _, digest = base.partition("@")
    assert tag == "python:3.11-slim"
    assert re.fullmatch(r"sha256:[0-9a-f]{64}", digest), base


@pytest.mark.parametrize("dockerfile", [DOCKERFILE, EXAMPLE / "Dockerfile"], ids=["base", "team"])
def test_no_dockerfile_pulls_an_image_by_tag(dockerfile: Path) -> None:
    assert _unpinned(dockerfile.read_text()) == []


def test_a_base_image_named_by_tag_alone_is_caught() -> None:
    digest = "@sha256:" + "0" * 64
    text = f"""FROM python:3.11-slim{digest} AS build
FROM build
FROM python:3.11-slim
ARG OTHER=rabbit-pg-consumer:{consumer.__version__}
FROM rabbit-pg-consumer:{consumer.__version__}
"""
    # The FROM line without a digest, and this repository's image named outright (not as the
    # build argument a team pins), are caught; the digest and the earlier stage are not
    assert _unpinned(text) == ["python:3.11-slim", f"rabbit-pg-consumer:{consumer.__version__}"]
    assert _unpinned("ARG BASE=python:3.11-slim\nFROM ${BASE}\n") == ["python:3.11-slim"]


def test_the_pin_script_moves_every_from_line_to_the_digest_the_tag_names(tmp_path: Path) -> None:
    # Given a copy of the Dockerfile, and a registry client that resolves the tag to a new digest
    # (crane, the first the script tries; no registry is reachable here)
    new = "sha256:" + "ab" * 32
    tools = tmp_path / "bin"
    tools.mkdir()
    crane = tools / "crane"
    crane.write_text(f'#!/bin/sh\n[ "$1 $2" = "digest python:3.11-slim" ] && echo {new}\n')
    crane.chmod(0o755)
    copy = tmp_path / "Dockerfile"
    copy.write_text(DOCKERFILE.read_text())

    # When the script runs on it
    result = subprocess.run(
        ["bash", str(DEPLOY / "local" / "pin-base-image.sh"), str(copy)],
        env={"PATH": f"{tools}:/usr/bin:/bin"},
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )

    # Then both stages start from the new digest and nothing else changed
    assert result.returncode == 0, result.stdout + result.stderr
    assert [stage[0].arguments for stage in _stages(copy)] == [
        f"python:3.11-slim@{new} AS build",
        f"python:3.11-slim@{new}",
    ]
    old = _stages()[0][0].arguments.split()[0].partition("@")[2]
    assert copy.read_text() == DOCKERFILE.read_text().replace(old, new)


def test_the_runtime_stage_is_unprivileged_and_stops_on_sigterm() -> None:
    final = _final_stage()

    user = _only(final, "USER").split(":")[0]
    assert user not in ("root", "0")
    assert _only(final, "STOPSIGNAL") == "SIGTERM"
    assert json.loads(_only(final, "CMD")) == ["consumer", "run"]
    assert _environment(final)["CONSUMER_HTTP_HOST"] == "0.0.0.0"
    assert "/healthz" in _only(final, "HEALTHCHECK")
    runs = " ".join(i.arguments for i in final if i.keyword == "RUN")
    assert not re.search(r"apt-get|gcc|build-essential|pip install", runs), runs


def test_the_build_stage_installs_the_locked_dependencies_then_the_package_alone() -> None:
    build = _stages()[0]
    steps = [(i.keyword, i.arguments) for i in build]
    copy_lock = steps.index(("COPY", f"{LOCK_FILE} ./"))
    installs = [n for n, (keyword, arguments) in enumerate(steps) if "pip install" in arguments]

    # First the lock, hash-checked, wheels only
    locked, package = installs
    assert copy_lock < locked
    for flag in ("--require-hashes", "--only-binary=:all:", "-r requirements.lock"):
        assert flag in steps[locked][1], flag
    # then the package's wheel, built with the locked setuptools, without any dependency
    assert "pip wheel --no-cache-dir --no-deps --no-build-isolation" in steps[package][1]
    assert "pip install --no-cache-dir --no-deps /tmp/wheel/" in steps[package][1]
    assert steps[package][1].endswith("pip uninstall --yes pip setuptools")


def test_the_runtime_stage_runs_the_installed_package_not_a_source_tree() -> None:
    final = _final_stage()

    # Only the build stage's virtualenv, and the console script on PATH
    assert [i.arguments for i in final if i.keyword == "COPY"] == [
        "--from=build /opt/venv /opt/venv"
    ]
    environment = _environment(final)
    assert "PYTHONPATH" not in environment
    assert environment["PATH"].split(":")[0] == "/opt/venv/bin"


def test_the_build_context_has_what_copy_needs_and_nothing_else() -> None:
    rules = _dockerignore()
    copied = [source for stage in _stages() for sources, _ in _copies(stage) for source in sources]

    for source in copied:
        files = _context_files(source)
        assert files, f"COPY {source}: nothing there"
        kept = [f for f in files if "__pycache__" not in f]
        assert not [f for f in kept if _excluded(f, rules)], f"COPY {source}: excluded files"
    for outside in (".git/HEAD", ".venv/bin/python", "tests/conftest.py", "deploy/Dockerfile"):
        assert _excluded(outside, rules), f"{outside} would be sent to the Docker daemon"
    assert _excluded("consumer/__pycache__/cli.cpython-311.pyc", rules)


def _stage(stage: list[Instruction], root: Path) -> Path:
    """Carry out a stage's COPY lines from the build context (after .dockerignore) under
    ``root``; returns where its WORKDIR is."""
    workdir = root / _only(stage, "WORKDIR").lstrip("/")
    workdir.mkdir(parents=True)
    rules = _dockerignore()
    for sources, destination in _copies(stage):
        for source in sources:
            target = workdir / destination
            for file in _context_files(source):
                if _excluded(file, rules):
                    continue
                source_path = REPO / source
                relative = (
                    Path(file).relative_to(source) if source_path.is_dir() else source_path.name
                )
                (target / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / file, target / relative)
    return workdir


def test_the_build_stage_builds_the_package_from_what_it_copies(
    tmp_path: Path, installed_product: Installed
) -> None:
    # Given the build stage's COPY lines carried out from the filtered context
    source = _stage(_stages()[0], tmp_path / "build")

    # When the package is built from there (offline, with the virtualenv's setuptools)
    wheel = build_wheel(source, tmp_path)

    # Then it is the wheel tests/install installs: same files, same contents
    assert _record(wheel) == _record(installed_product.service_wheel)
    copied = {source for sources, _ in _copies(_stages()[0]) for source in sources}
    # (and the lock its dependencies come from: tests/deploy/test_lock.py)
    assert copied == {*SERVICE_SOURCES, LOCK_FILE}


def _record(wheel: Path) -> set[str]:
    """Each file of a wheel with its hash (its RECORD, less the line of the RECORD itself)."""
    with zipfile.ZipFile(wheel) as archive:
        (record,) = [name for name in archive.namelist() if name.endswith(".dist-info/RECORD")]
        return {line for line in archive.read(record).decode().splitlines() if record not in line}


class ImageService(InstalledService):
    """``CMD`` of the image, from the installed virtualenv with the image's ENV."""

    def __init__(self, test_env: TestEnv, installed: Installed, image_env: dict[str, str]) -> None:
        # The image has the reference handlers only (tests/ is not in it).
        super().__init__(
            test_env,
            installed,
            http_port=str(free_port()),
            handlers=",".join(DEFAULT_HANDLER_MODULES),
        )
        self.environment = {**self.environment, **_without_path(image_env)}


def _without_path(image_env: dict[str, str]) -> dict[str, str]:
    # PATH points at the image's /opt/venv/bin: here, the installed virtualenv's stands in for it.
    return {k: v for k, v in image_env.items() if k not in ("PATH", "CONSUMER_HTTP_PORT")}


async def test_the_image_commands_migrate_declare_run_and_pass_the_healthcheck(
    env: TestEnv, admin_dsn: str, installed_product: Installed
) -> None:
    # Given the image's ENV, its virtualenv (the installed wheel) and an empty database name
    final = _final_stage()
    image_env = _environment(final)
    assert image_env["PATH"].startswith("/opt/venv/bin:")
    database = f"ctest_image_{uuid.uuid4().hex[:8]}"
    database_url = env.database_url.rsplit("/", 1)[0] + "/" + database
    service = ImageService(env, installed_product, image_env)
    try:
        # When the jobs of compose and Kubernetes run the image's commands
        migrate = installed_product.run(
            "consumer",
            "migrate",
            "--create-database",
            env={**service.environment, "CONSUMER_DATABASE_URL": database_url},
        )
        topology = installed_product.run("consumer", "topology", "apply", env=service.environment)

        # Then both succeed: the service's set and the reference handlers' set are applied
        assert migrate.returncode == 0, migrate.stderr
        assert f"created database {database}" in migrate.stdout
        for migration_set, folder in (
            ("consumer.sql", REPO / "sql"),
            ("consumer.handlers.sql", REPO / "consumer" / "handlers" / "sql"),
        ):
            for sql in sorted(folder.glob("*.sql")):
                assert f"applied {migration_set}/{sql.name}" in migrate.stdout
        assert await fetchval(database_url, "SELECT count(*) FROM stock") == 0
        assert topology.returncode == 0, topology.stderr
        env.topologies.append(env.topology(handlers=",".join(DEFAULT_HANDLER_MODULES)))
    finally:
        admin = await asyncpg.connect(admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        finally:
            await admin.close()

    # When the image's CMD runs, listening where CONSUMER_HTTP_HOST of the image says
    assert json.loads(_only(final, "CMD")) == ["consumer", "run"]
    await service.start().wait_ready()
    healthcheck = json.loads(_only(final, "HEALTHCHECK").split("CMD", 1)[1])
    assert healthcheck[0] == "python"
    probe_env = {**service.environment}

    def probe(port: int) -> int:
        probe_env["CONSUMER_HTTP_PORT"] = str(port)
        return installed_product.run(*healthcheck, env=probe_env, timeout=10).returncode

    # Then its HEALTHCHECK passes against it, and fails where nothing listens
    assert service.environment["CONSUMER_HTTP_HOST"] == "0.0.0.0"
    assert probe(service.port) == 0
    assert probe(free_port()) != 0
    assert await service.stop() == 0


# -- the team's image: examples/Dockerfile -------------------------------------------------------

EXAMPLE_DOCKERFILE = EXAMPLE / "Dockerfile"


def test_the_teams_dockerfile_passes_hadolint() -> None:
    assert_clean(run_tool("hadolint", "--failure-threshold", "style", str(EXAMPLE_DOCKERFILE)))


def test_the_teams_image_extends_the_base_by_installing_its_package_into_the_base_venv() -> None:
    (stage,) = _stages(EXAMPLE_DOCKERFILE)
    (make_venv,) = [i.arguments for i in _stages()[0] if i.arguments.startswith("python -m venv")]
    base_venv = make_venv.split()[-1]

    # It starts from this release's base image (a build argument, for the digest a team pushed)
    # and installs the package into its virtualenv
    [(base, argument)] = _bases(EXAMPLE_DOCKERFILE.read_text())
    assert base == f"rabbit-pg-consumer:{consumer.__version__}"
    assert argument == "BASE_IMAGE"
    (install,) = [i.arguments for i in stage if i.keyword == "RUN"]
    assert f"--python {base_venv}/bin/python install" in install
    # and runs as the base does, its own handlers named
    users = [i.arguments for i in stage if i.keyword == "USER"]
    assert users[-1] == _only(_final_stage(), "USER")
    assert _environment(stage)["CONSUMER_HANDLERS"] == EXAMPLE_HANDLERS
    assert not [i for i in stage if i.keyword in ("CMD", "ENTRYPOINT")], "the base's CMD runs"
    # and its build context is the package: pyproject.toml and billing/
    rules = _dockerignore(EXAMPLE / ".dockerignore")
    assert not _excluded("pyproject.toml", rules)
    assert not _excluded("billing/handlers.py", rules)
    assert not _excluded("billing/sql/001_charges_and_refunds.sql", rules)
    assert _excluded("README.md", rules)
