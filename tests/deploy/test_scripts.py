"""deploy/local's shell scripts pass shellcheck."""

from __future__ import annotations

import pytest

from tests.deploy.support import DEPLOY, assert_clean, run_tool

# services.sh keeps one informational note (SC2012, `ls` to pick the newest cluster version).
SEVERITY = {"tools.sh": "style", "services.sh": "warning"}


@pytest.mark.parametrize("script", sorted(p.name for p in (DEPLOY / "local").glob("*.sh")))
def test_shellcheck_passes(script: str) -> None:
    result = run_tool(
        "shellcheck", f"--severity={SEVERITY[script]}", str(DEPLOY / "local" / script)
    )

    assert_clean(result)
    assert not result.stdout.strip(), result.stdout
