"""``consumer`` is the one command: its version, and ``topology`` as one of its subcommands."""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import subprocess
import sys
import tomllib
from typing import Any, cast

import pytest
from prometheus_client import CollectorRegistry

import consumer
import consumer.cli.main as main_module
from consumer.cli.main import main
from consumer.config.startup import EXIT_CONFIG
from consumer.observe.metrics import Metrics
from tests.support import REPO


@pytest.fixture(autouse=True)
def _default_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in list(os.environ):
        if key.upper().startswith("CONSUMER_"):
            monkeypatch.delenv(key)


def test_version_prints_the_one_version_without_reading_settings(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("CONSUMER_PREFETCH", "not even a number")

    with pytest.raises(SystemExit) as caught:
        main(["--version"])

    assert caught.value.code == 0
    assert capsys.readouterr().out == f"rabbit-pg-consumer {consumer.__version__}\n"


def test_the_package_metadata_and_build_info_take_the_version_from_one_place() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())

    assert "version" not in project["project"]
    assert project["project"]["dynamic"] == ["version"]
    source = project["tool"]["setuptools"]["dynamic"]["version"]["attr"]
    module, _, name = source.rpartition(".")
    assert getattr(importlib.import_module(module), name) == consumer.__version__
    metrics = Metrics(CollectorRegistry(), ["example.type"])
    assert (
        metrics.registry.get_sample_value(
            "consumer_build_info",
            {"version": consumer.__version__, "python": platform.python_version()},
        )
        == 1
    )


def test_topology_is_a_subcommand_and_python_m_topology_the_same(
    capsys: pytest.CaptureFixture[str],
) -> None:
    assert main(["topology", "apply", "--dry-run"]) == 0
    through_consumer = capsys.readouterr().out
    alias = subprocess.run(
        [sys.executable, "-m", "topology", "apply", "--dry-run"],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")},
        check=True,
    )
    through_topology = alias.stdout

    assert "queue consumer.work" in through_consumer
    assert through_consumer == through_topology


def test_usage_names_the_consumer_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])

    usage = capsys.readouterr().out
    assert usage.startswith("usage: consumer ")
    # The usage paragraph (argparse wraps it once the commands no longer fit on one line).
    paragraph = usage.split("\n\n")[0]
    for command in ("run", "migrate", "topology", "publish", "dlq", "receipts", "catalogue"):
        assert command in paragraph


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
async def test_publish_refuses_a_payload_json_has_no_way_to_write(
    constant: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Given a --payload with a constant json.loads takes but JSON has not
    arguments = argparse.Namespace(payload=f'{{"ratio": {constant}}}')

    # Then the command stops with one line before it loads anything or connects
    with pytest.raises(SystemExit) as stopped:
        await main_module._publish(cast(Any, None), arguments)
    assert stopped.value.code == EXIT_CONFIG
    assert f"--payload is not JSON: {constant} is no JSON value" in capsys.readouterr().err
