"""A bad setting stops start-up with one line naming it, exit code 2, no traceback."""

from __future__ import annotations

import pytest

from tests.support import TestEnv, run_cli


@pytest.mark.parametrize(
    ("command", "setting", "value"),
    [
        (("consumer", "run"), "prefetch", "lots"),
        (("consumer", "run"), "retry_delays", "1s,soon"),
        (("consumer", "run"), "log_level", "chatty"),
        (("consumer", "migrate"), "database_url", "mysql://root@db/x"),
        (("topology", "apply"), "delivery_limit", "-1"),
        (("consumer", "run"), "handlers", "no.such.module"),
        # 400 prefetched bodies of up to 256 KiB cannot fit in 128 MiB
        (("consumer", "run"), "memory_limit", "128MiB"),
        (("consumer", "run"), "retry_delays", ""),
        (("consumer", "run"), "max_clock_skew", "2h"),
        (("consumer", "dlq", "list"), "prefech", "10"),
    ],
)
async def test_bad_setting_gives_one_line_and_exit_2(
    env: TestEnv, command: tuple[str, ...], setting: str, value: str
) -> None:
    result = run_cli(command[0], *command[1:], env=env.env(**{setting: value}))
    assert result.returncode == 2
    assert result.stdout == ""
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert f"CONSUMER_{setting.upper()}" in lines[0]
    assert "Traceback" not in result.stderr


def test_a_misspelt_variable_stops_start_up_naming_the_setting_it_resembles(env: TestEnv) -> None:
    result = run_cli("consumer", "run", env=env.env(prefech="10"))

    assert result.returncode == 2
    assert result.stderr == (
        "error: CONSUMER_PREFECH is not a setting (did you mean CONSUMER_PREFETCH?)\n"
    )
