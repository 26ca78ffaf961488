"""A command whose reader went away (``consumer events show ... | head``) ends as Unix tools do:
killed by SIGPIPE (exit status 141 in a shell), with no traceback and no second error.

Python ignores SIGPIPE so that a socket's broken pipe is an exception, not the end of the
process; the commands keep it so (their own connections to RabbitMQ and PostgreSQL must not kill
them). Only a write to standard output that finds its reader gone ends the command: ``consumer``'s
main catches that :class:`BrokenPipeError` and calls :func:`end_by_sigpipe`.
"""

from __future__ import annotations

import os
import signal
import sys
from typing import NoReturn

__all__ = ["end_by_sigpipe"]


def end_by_sigpipe() -> NoReturn:
    """Exit as a process killed by SIGPIPE. Standard output goes to /dev/null first: the
    interpreter's last flush of what is still buffered would only fail again."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    if hasattr(signal, "SIGPIPE"):
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGPIPE)
    os._exit(128 + 13)
