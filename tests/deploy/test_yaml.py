"""Every YAML file under deploy/ passes yamllint (deploy/.yamllint.yaml, strict: warnings fail)."""

from __future__ import annotations

from tests.deploy.support import DEPLOY, assert_clean, run_tool


def test_yamllint_passes_on_deploy() -> None:
    result = run_tool("yamllint", "--strict", "-c", str(DEPLOY / ".yamllint.yaml"), str(DEPLOY))

    assert_clean(result)
    assert not result.stdout.strip(), result.stdout


def test_yamllint_reads_every_yaml_file_there() -> None:
    listed = run_tool("yamllint", "--list-files", "-c", str(DEPLOY / ".yamllint.yaml"), str(DEPLOY))
    on_disk = {p for p in DEPLOY.rglob("*") if p.suffix in (".yaml", ".yml")}

    assert listed.returncode == 0, listed.stderr
    assert {p for p in on_disk if str(p) not in listed.stdout.split()} == set()
