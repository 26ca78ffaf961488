"""What the consumers' processes use, read from ``/proc`` (Linux): their CPU time, their resident
memory (sampled, and the kernel's high-water mark), and the memory budget each logged at start-up
(``memory_budget_bytes`` on its ``starting`` line: the worst case its start-up check fitted to the
memory limit, :mod:`consumer.service.memory`)."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

SAMPLE_EVERY = 0.2
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def parse_cpu_seconds(stat: str, ticks: int = _TICKS) -> float:
    """User + system CPU seconds from ``/proc/<pid>/stat`` (fields 14 and 15, counted after the
    command name, which may hold spaces and parentheses)."""
    fields = stat[stat.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / ticks


def parse_memory(status: str) -> tuple[int, int]:
    """(VmRSS, VmHWM) in bytes from ``/proc/<pid>/status``; 0 for a line that is not there."""
    found = {"VmRSS": 0, "VmHWM": 0}
    for line in status.splitlines():
        name, _, value = line.partition(":")
        if name in found:
            found[name] = int(value.split()[0]) * 1024  # kB
    return found["VmRSS"], found["VmHWM"]


def cpu_seconds(pid: int) -> float | None:
    try:
        return parse_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())
    except (OSError, ValueError, IndexError):
        return None


def memory(pid: int) -> tuple[int, int]:
    try:
        return parse_memory(Path(f"/proc/{pid}/status").read_text())
    except (OSError, ValueError, IndexError):
        return 0, 0


def cpu_used(before: Mapping[int, float], after: Mapping[int, float]) -> float:
    """CPU seconds the processes alive at both readings used between them (a process started or
    ended in between is left out: its share is unknown)."""
    return sum(after[pid] - before[pid] for pid in before.keys() & after.keys())


def memory_budget(lines: Iterable[Mapping[str, Any]]) -> int | None:
    """The ``memory_budget_bytes`` of the first ``starting`` log line that has one."""
    for line in lines:
        budget = line.get("memory_budget_bytes")
        if line.get("event") == "starting" and isinstance(budget, int):
            return budget
    return None


class RssSampler:
    """The highest resident memory of the processes ``pids()`` names, sampled all along (the
    high-water mark of a process that ended is lost with it; :meth:`finish` adds the kernel's
    own for those still running)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        self.peak = 0

    def sample(self) -> None:
        for pid in self._pids():
            self.peak = max(self.peak, memory(pid)[0])

    async def run(self) -> None:
        while True:
            self.sample()
            await asyncio.sleep(SAMPLE_EVERY)

    def finish(self) -> int:
        for pid in self._pids():
            rss, hwm = memory(pid)
            self.peak = max(self.peak, rss, hwm)
        return self.peak
