"""The event loop every long-running command runs on: uvloop where it is installed.

uvloop is a dependency except on Windows; its loop costs a fraction of asyncio's per callback,
which is most of what a command that handles a message at a time spends (``dlq replay``).
"""

from __future__ import annotations

import asyncio
from collections.abc import Coroutine
from typing import Any, TypeVar

__all__ = ["run_event_loop"]

T = TypeVar("T")


def run_event_loop(coroutine: Coroutine[Any, Any, T]) -> T:
    """``asyncio.run`` on uvloop's loop (same cancellation and Ctrl-C handling)."""
    try:
        import uvloop
    except ImportError:  # pragma: no cover - uvloop is a dependency except on Windows
        return asyncio.run(coroutine)
    return uvloop.run(coroutine)
