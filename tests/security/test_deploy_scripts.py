"""The security deploy scripts: shellcheck on users.sh (roles.sql runs for real in
test_least_privilege and test_no_password_leaks)."""

from __future__ import annotations

from tests.deploy.support import assert_clean, run_tool
from tests.security.support import USERS_SH


def test_users_script_passes_shellcheck() -> None:
    result = run_tool("shellcheck", "--severity=style", str(USERS_SH))

    assert_clean(result)
    assert not result.stdout.strip(), result.stdout
