"""Memory and CPU of processes, read from ``/proc`` (Linux only; no third-party dependency).

``VmRSS`` is the resident set now, ``VmHWM`` its peak over the process's life ("high water mark").
CPU is user + system time in clock ticks, turned into "percent of one core" over a window.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")
PROC = Path("/proc")


def _read(path: Path) -> str | None:
    try:
        return path.read_text(errors="replace")
    except OSError:  # the process exited, or is not ours to read
        return None


def status_kb(pid: int, key: str) -> int | None:
    """A ``kB`` field of ``/proc/<pid>/status`` (``VmRSS``, ``VmHWM``), or None if gone."""
    text = _read(PROC / str(pid) / "status")
    if text is None:
        return None
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    return None


def _stat_fields(pid: int) -> list[str] | None:
    text = _read(PROC / str(pid) / "stat")
    if text is None:
        return None
    # The command name is in parentheses and may hold spaces: split after the last ')'.
    return text.rsplit(")", 1)[1].split()


def cpu_ticks(pid: int) -> int | None:
    """User + system CPU time of ``pid`` (its own threads, not its children) in clock ticks."""
    fields = _stat_fields(pid)
    if fields is None:
        return None
    return int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of stat)


def all_pids() -> list[int]:
    return [int(entry.name) for entry in PROC.iterdir() if entry.name.isdigit()]


def process_tree(root: int) -> list[int]:
    """``root`` and all its descendants that are alive now."""
    children: dict[int, list[int]] = {}
    for pid in all_pids():
        fields = _stat_fields(pid)
        if fields is not None:
            children.setdefault(int(fields[1]), []).append(pid)
    tree, todo = [], [root]
    while todo:
        pid = todo.pop()
        tree.append(pid)
        todo.extend(children.get(pid, ()))
    return tree


def pids_named(name: str, *, cmdline_contains: str | None = None) -> list[int]:
    """Processes whose command name is ``name`` (and whose command line holds a string)."""
    found = []
    for pid in all_pids():
        comm = _read(PROC / str(pid) / "comm")
        if comm is None or comm.strip() != name:
            continue
        if cmdline_contains is not None:
            cmdline = _read(PROC / str(pid) / "cmdline")
            if cmdline is None or cmdline_contains not in cmdline:
                continue
        found.append(pid)
    return found


def rss_mb(pids: Iterable[int], key: str = "VmRSS") -> float:
    """The sum of ``key`` (``VmRSS`` or ``VmHWM``) over ``pids``, in MiB."""
    return sum(status_kb(pid, key) or 0 for pid in pids) / 1024


def machine_ticks() -> tuple[int, int]:
    """(busy, total) CPU ticks of the whole machine, all cores, from ``/proc/stat``."""
    text = _read(PROC / "stat") or "cpu 0 0 0 0"
    values = [int(value) for value in text.splitlines()[0].split()[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0)  # idle + iowait
    return sum(values) - idle, sum(values)


@dataclass(frozen=True, slots=True)
class Named:
    """Processes by command name, e.g. ``postgres`` backends whose title names a database."""

    name: str
    cmdline_contains: str | None = None


# A process tree (its root's pid) or processes found by name.
ProcessGroup = int | Named


@dataclass
class CpuSnapshot:
    """CPU ticks of some groups of processes at one moment."""

    groups: dict[str, dict[int, int]] = field(default_factory=dict)
    machine: tuple[int, int] = (0, 0)


class CpuWatch:
    """CPU use of named process groups between :meth:`start` and :meth:`stop`.

    Groups are re-resolved at each snapshot (a process tree gains children as it starts up). A
    process that appears after :meth:`start` counts all its CPU time; one that exits before
    :meth:`stop` counts what it had used when last seen, so call :meth:`sample` now and then while
    processes come and go (database backends closing as a client disconnects).
    """

    def __init__(self, groups: dict[str, ProcessGroup]) -> None:
        self._groups = groups
        self._start: CpuSnapshot | None = None
        self._seen: dict[str, dict[int, int]] = {}
        self._start_time = 0.0

    @staticmethod
    def _resolve(group: ProcessGroup) -> list[int]:
        if isinstance(group, Named):
            return pids_named(group.name, cmdline_contains=group.cmdline_contains)
        return process_tree(group)

    def snapshot(self) -> CpuSnapshot:
        snap = CpuSnapshot(machine=machine_ticks())
        for label, group in self._groups.items():
            ticks = {}
            for pid in self._resolve(group):
                value = cpu_ticks(pid)
                if value is not None:
                    ticks[pid] = value
            snap.groups[label] = ticks
        return snap

    def start(self, now: float) -> None:
        self._start = self.snapshot()
        self._seen = {label: dict(ticks) for label, ticks in self._start.groups.items()}
        self._start_time = now

    @property
    def started(self) -> bool:
        return self._start is not None

    @property
    def started_at(self) -> float:
        return self._start_time

    def sample(self) -> CpuSnapshot:
        snap = self.snapshot()
        for label, ticks in snap.groups.items():
            self._seen.setdefault(label, {}).update(ticks)
        return snap

    def stop(self, now: float) -> dict[str, float]:
        """Percent of one core per group, and ``machine`` (percent of all cores, 0-100)."""
        if self._start is None:
            return {}
        end = self.sample()
        seconds = max(now - self._start_time, 1e-9)
        result: dict[str, float] = {}
        for label, ticks in self._seen.items():
            before = self._start.groups.get(label, {})
            used = sum(max(value - before.get(pid, 0), 0) for pid, value in ticks.items())
            result[label] = round(100 * used / CLOCK_TICKS / seconds, 1)
        busy = end.machine[0] - self._start.machine[0]
        total = end.machine[1] - self._start.machine[1]
        result["machine"] = round(100 * busy / total, 1) if total > 0 else 0.0
        return result
