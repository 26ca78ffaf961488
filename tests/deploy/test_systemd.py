"""deploy/systemd: the units pass ``systemd-analyze verify`` and score as well hardened in
``systemd-analyze security --offline``, and the example environment file is valid settings.

systemd is not PID 1 where these tests run, so the units are checked, not started. They are
verified inside a staged root (``--root``): the units where they are installed, the distribution's
own units beside them (their dependencies resolve), and an executable where ExecStart expects the
virtualenv's python (verify requires it to exist; it does not run it).
"""

from __future__ import annotations

import configparser
import shutil
from pathlib import Path

import pytest

from consumer.config.settings import Settings
from consumer.durations import parse_duration
from tests.deploy.support import (
    SYSTEMD,
    assert_clean,
    run_tool,
    settings_fields,
    unit_environment,
    unit_values,
)

UNITS = ("consumer.service", "consumer-migrate.service", "consumer-topology.service")
SYSTEM_UNITS = Path("/usr/lib/systemd/system")
# systemd-analyze security's exposure, in tenths (10.0 is "UNSAFE"): the units score 1.2 today.
EXPOSURE_THRESHOLD = 20
# The installed package's console script, in the virtualenv deploy/README.md installs.
CONSUMER = "/opt/rabbit-pg-consumer/bin/consumer"


def _unit(name: str) -> configparser.RawConfigParser:
    parser = configparser.RawConfigParser(strict=False, interpolation=None, delimiters=("=",))
    parser.optionxform = str  # type: ignore[assignment,method-assign]
    parser.read(SYSTEMD / name)
    return parser


def _exec_start(name: str) -> Path:
    return Path(_unit(name)["Service"]["ExecStart"].split()[0])


@pytest.fixture
def staged_root(tmp_path: Path) -> Path:
    root = tmp_path / "root"
    shutil.copytree(SYSTEM_UNITS, root / SYSTEM_UNITS.relative_to("/"), symlinks=True)
    (root / "etc/systemd/system").mkdir(parents=True)
    for name in UNITS:
        shutil.copy(SYSTEMD / name, root / "etc/systemd/system" / name)
        executable = root / _exec_start(name).relative_to("/")
        executable.parent.mkdir(parents=True, exist_ok=True)
        executable.write_text("#!/bin/sh\n")
        executable.chmod(0o755)
    return root


@pytest.mark.parametrize("unit", UNITS)
def test_systemd_analyze_verify_passes(staged_root: Path, unit: str) -> None:
    assert SYSTEM_UNITS.is_dir(), "systemd's units are not installed (deploy/local/tools.sh)"

    result = run_tool("systemd-analyze", "verify", f"--root={staged_root}", unit)

    assert_clean(result)


@pytest.mark.parametrize("unit", UNITS)
def test_the_units_are_hardened(staged_root: Path, unit: str) -> None:
    result = run_tool(
        "systemd-analyze",
        "security",
        "--offline=true",
        f"--root={staged_root}",
        f"--threshold={EXPOSURE_THRESHOLD}",
        "--no-pager",
        unit,
    )

    assert result.returncode == 0, result.stdout[-2000:] + result.stderr
    service = _unit(unit)["Service"]
    for setting in ("DynamicUser", "NoNewPrivileges", "PrivateTmp", "ProtectHome"):
        assert service[setting] == "yes", setting
    assert service["ProtectSystem"] == "strict"
    # The shared settings, then the unit's own file (its credentials: tests/deploy/test_credentials)
    own = unit.removesuffix(".service")
    assert unit_values(unit, "EnvironmentFile") == [
        "/etc/consumer/common.env",
        f"/etc/consumer/{own}.env",
    ]


def test_the_service_restarts_on_failure_and_outlasts_the_shutdown_grace() -> None:
    service = _unit("consumer.service")["Service"]
    settings = _example_settings()

    assert service["Restart"] == "on-failure"
    assert service["KillSignal"] == "SIGTERM"
    assert parse_duration(service["TimeoutStopSec"]) > settings.shutdown_grace
    assert service["ExecStart"] == f"{CONSUMER} run"


def test_the_service_needs_the_one_shot_jobs_and_starts_after_them() -> None:
    unit = _unit("consumer.service")["Unit"]

    for job, command in (
        ("consumer-migrate.service", f"{CONSUMER} migrate"),
        ("consumer-topology.service", f"{CONSUMER} topology apply"),
    ):
        assert job in unit["Requires"].split()
        assert job in unit["After"].split()
        service = _unit(job)["Service"]
        assert service["Type"] == "oneshot"
        assert service["ExecStart"] == command
        assert _unit(job)["Unit"]["PartOf"] == "consumer.service"


def _example_settings(unit: str = "consumer.service") -> Settings:
    """What a unit starts with, from the example files of its EnvironmentFile= lines."""
    values = unit_environment(unit)
    fields = settings_fields(values)
    assert all(key.startswith("CONSUMER_") for key in values), sorted(values)
    assert set(fields) <= set(Settings.model_fields), sorted(fields)
    return Settings.model_validate(fields)


@pytest.mark.parametrize("unit", UNITS)
def test_the_units_run_the_installed_package_not_a_source_tree(unit: str) -> None:
    service = _unit(unit)["Service"]

    assert _exec_start(unit) == Path(CONSUMER)
    assert "PYTHONPATH" not in service.get("Environment", "")
    assert "WorkingDirectory" not in service


@pytest.mark.parametrize("unit", UNITS)
def test_the_example_environment_files_are_valid_settings(unit: str) -> None:
    settings = _example_settings(unit)

    assert settings.log_format == "json"
    assert settings.amqp_url.get_secret_value().startswith("amqp://")
