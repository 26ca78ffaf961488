"""deploy/Dockerfile and .dockerignore.

No Docker engine runs where these tests run, so the image is never built here. What is checked:
hadolint lints the Dockerfile; the final stage's settings are asserted; .dockerignore is read with
Docker's matching rules (re-implemented below) to see that every COPY source reaches the build and
nothing else does; the build stage's COPY lines are carried out in a folder and the package's wheel
is built from it; and the runtime stage's layout (its COPY lines and ENV, WORKDIR /app) is staged
in a folder, from which the image's three commands (migrate, topology apply, run) and its
HEALTHCHECK command run against the real broker and database, on this machine's Python. Not
covered: the base image, installing the dependencies into /opt/venv, and running as uid 10001.
"""

from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess
import sys
import uuid
import zipfile
from dataclasses import dataclass
from pathlib import Path

import asyncpg

from consumer.settings import DEFAULT_HANDLER_MODULES
from tests.deploy.support import DEPLOY, assert_clean, run_tool
from tests.servers import free_port
from tests.support import REPO, ServiceProcess, TestEnv, fetchval

DOCKERFILE = DEPLOY / "Dockerfile"


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


def _stages() -> list[list[Instruction]]:
    stages: list[list[Instruction]] = []
    for instruction in _instructions(DOCKERFILE.read_text()):
        if instruction.keyword == "FROM":
            stages.append([])
        stages[-1].append(instruction)
    return stages


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


def _dockerignore() -> list[tuple[bool, re.Pattern[str]]]:
    rules = []
    for raw in (REPO / ".dockerignore").read_text().splitlines():
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


def test_every_stage_starts_from_the_slim_python_311_image() -> None:
    bases = [stage[0].arguments.split()[0] for stage in _stages()]

    assert len(bases) >= 2, "a build stage and a runtime stage"
    assert set(bases) == {"python:3.11-slim"}


def test_the_runtime_stage_is_unprivileged_and_stops_on_sigterm() -> None:
    final = _final_stage()

    user = _only(final, "USER").split(":")[0]
    assert user not in ("root", "0")
    assert _only(final, "STOPSIGNAL") == "SIGTERM"
    assert json.loads(_only(final, "CMD")) == ["python", "-m", "consumer", "run"]
    assert _environment(final)["CONSUMER_HTTP_HOST"] == "0.0.0.0"
    assert "/healthz" in _only(final, "HEALTHCHECK")
    runs = " ".join(i.arguments for i in final if i.keyword == "RUN")
    assert not re.search(r"apt-get|gcc|build-essential|pip install", runs), runs


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
                relative = Path(file).relative_to(source) if (REPO / source).is_dir() else file
                (target / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(REPO / file, target / relative)
    return workdir


def _stage_runtime_layout(root: Path) -> tuple[Path, dict[str, str]]:
    """The runtime stage's files under ``root`` (its WORKDIR becomes ``root/app``), and its ENV."""
    final = _final_stage()
    app = _stage(final, root)
    environment = _environment(final)
    assert environment["PYTHONPATH"] == _only(final, "WORKDIR"), "code is imported from WORKDIR"
    return app, environment


def test_the_build_stage_builds_the_package_from_what_it_copies(tmp_path: Path) -> None:
    # Given the build stage's COPY lines carried out from the filtered context
    source = _stage(_stages()[0], tmp_path / "build")

    # When the package is built from there (offline, with the virtualenv's setuptools)
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
            str(tmp_path / "wheels"),
            str(source),
        ],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )

    # Then a wheel with both packages comes out
    assert result.returncode == 0, result.stdout + result.stderr
    (wheel,) = (tmp_path / "wheels").glob("rabbit_pg_consumer-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    assert {"consumer/cli.py", "consumer/py.typed", "topology/cli.py"} <= names


class StagedService(ServiceProcess):
    """``CMD`` of the image, run from the staged layout with the image's ENV (cwd = WORKDIR)."""

    def __init__(self, test_env: TestEnv, app: Path, image_env: dict[str, str]) -> None:
        # The image has the reference handlers only (tests/ is not in it).
        super().__init__(
            test_env,
            "image-layout",
            http_port=str(free_port()),
            handlers=",".join(DEFAULT_HANDLER_MODULES),
        )
        image_env = {k: v for k, v in image_env.items() if k not in ("PATH", "CONSUMER_HTTP_PORT")}
        self.environment = {**self.environment, **image_env, "PYTHONPATH": str(app)}
        self.app = app

    def start(self) -> StagedService:
        log = self.log_path.open("ab")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "consumer", "run"],
            env=self.environment,
            stdout=log,
            stderr=subprocess.STDOUT,
            cwd=self.app,
        )
        log.close()
        return self


def _run_in_layout(
    app: Path, environment: dict[str, str], *argv: str
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, *argv],
        cwd=app,
        env=environment,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


async def test_the_image_layout_migrates_declares_runs_and_passes_its_healthcheck(
    env: TestEnv, admin_dsn: str, tmp_path: Path
) -> None:
    # Given the runtime stage staged in a folder, and an empty database name
    app, image_env = _stage_runtime_layout(tmp_path / "image")
    database = f"ctest_image_{uuid.uuid4().hex[:8]}"
    database_url = env.database_url.rsplit("/", 1)[0] + "/" + database
    service = StagedService(env, app, image_env)
    layout_env = {**service.environment, "CONSUMER_DATABASE_URL": database_url}
    try:
        # When the image's own commands run from it (compose's migrate and topology jobs)
        where = _run_in_layout(
            app,
            layout_env,
            "-c",
            "import consumer, consumer.migration_sets as m; print(consumer.__file__); "
            "print(m.service_set().folder)",
        )
        migrate = _run_in_layout(app, layout_env, "-m", "consumer", "migrate", "--create-database")
        topology = _run_in_layout(app, service.environment, "-m", "topology", "apply")

        # Then the code and the migrations come from the layout, and both jobs succeed
        assert where.returncode == 0, where.stderr
        module_file, migrations_dir = where.stdout.split()
        assert Path(module_file).is_relative_to(app)
        assert Path(migrations_dir) == app / "sql"
        assert migrate.returncode == 0, migrate.stderr
        assert f"created database {database}" in migrate.stdout
        for sql in sorted((REPO / "sql").glob("*.sql")):
            assert f"applied consumer.sql/{sql.name}" in migrate.stdout
        assert await fetchval(
            database_url,
            "SELECT count(*) FROM consumer_migrations WHERE migration_set = $1",
            "consumer.sql",
        ) == len(list((REPO / "sql").glob("*.sql")))
        assert topology.returncode == 0, topology.stderr
        env.topologies.append(env.topology(handlers=",".join(DEFAULT_HANDLER_MODULES)))
    finally:
        admin = await asyncpg.connect(admin_dsn)
        try:
            await admin.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        finally:
            await admin.close()

    # When the image's CMD runs, listening where CONSUMER_HTTP_HOST of the image says
    await service.start().wait_ready()
    healthcheck = json.loads(_only(_final_stage(), "HEALTHCHECK").split("CMD", 1)[1])
    assert healthcheck[0] == "python"
    probe_env = {**service.environment}

    def probe(port: int) -> int:
        probe_env["CONSUMER_HTTP_PORT"] = str(port)
        return subprocess.run(
            [sys.executable, *healthcheck[1:]], env=probe_env, capture_output=True, timeout=10
        ).returncode

    # Then its HEALTHCHECK passes against it, and fails where nothing listens
    assert service.environment["CONSUMER_HTTP_HOST"] == "0.0.0.0"
    assert probe(service.port) == 0
    assert probe(free_port()) != 0
    assert await service.stop() == 0
