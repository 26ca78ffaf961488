"""A command whose reader has gone (``consumer events show ... | head``) ends as Unix tools do:
by SIGPIPE (141 in a shell), with nothing on stderr, not a BrokenPipeError traceback."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import uuid

import pytest

from tests.support import REPO, TestEnv


def _into_a_closed_pipe(*args: str, env: dict[str, str] | None = None) -> tuple[int, str]:
    """``python -m consumer args`` writing into a pipe whose reader is already gone."""
    read, write = os.pipe()
    os.close(read)
    try:
        result = subprocess.run(
            [sys.executable, "-m", "consumer", *args],
            stdout=write,
            stderr=subprocess.PIPE,
            env=env if env is not None else {**os.environ, "PYTHONPATH": str(REPO)},
            cwd=REPO,
            text=True,
            timeout=120,
            check=False,
        )
    finally:
        os.close(write)
    return result.returncode, result.stderr


@pytest.mark.parametrize("args", [("--help",), ("dlq", "--help"), ("--version",)])
def test_help_into_a_closed_pipe_ends_quietly(args: tuple[str, ...]) -> None:
    code, stderr = _into_a_closed_pipe(*args)

    # argparse itself drops a failed write of its help; either way, not a word more
    assert code in (0, -signal.SIGPIPE), stderr
    assert stderr == ""


async def test_events_show_and_dlq_list_into_a_closed_pipe_end_by_sigpipe(env: TestEnv) -> None:
    await env.apply_topology()
    for args in (("events", "show", str(uuid.uuid4())), ("dlq", "list")):
        code, stderr = _into_a_closed_pipe(*args, env=env.env())

        assert code == -signal.SIGPIPE, (args, stderr)
        assert "Traceback" not in stderr
        assert "BrokenPipeError" not in stderr
