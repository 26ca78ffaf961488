"""What the prefetch can make the process hold, checked at start-up against what it may use.

Held deliveries keep their bodies: up to ``CONSUMER_PREFETCH`` x ``CONSUMER_MAX_BODY_BYTES``, since
a larger body is never kept: its frames are dropped as they arrive
(:mod:`consumer.amqp.direct_consume`; what reading them holds, a frame or ten of 128 KiB, is within
:data:`BASE_BYTES`). A parsed body costs up to about :data:`PARSED_EXPANSION` times its bytes in
Python objects (measured: a megabyte of short strings is nine of objects; containers, the costliest,
are bounded by ``CONSUMER_MAX_JSON_CONTAINERS``), so only small bodies stay parsed while they wait
(:data:`KEEP_PARSED_BYTES`); a larger one is parsed again by the worker that applies it, and a
worker's batch holds at most :data:`BATCH_BYTES` of bodies (or one body). Held deliveries keep
their decoded headers too: at most ``CONSUMER_MAX_HEADER_BYTES`` on the wire and
:data:`~consumer.amqp.field_table.MAX_HEADER_ENTRIES` entries (refused before decoding past
either), which decode to up to :data:`HEADER_EXPANSION` times their bytes (a byte that is not
UTF-8 becomes a two-byte replacement character) plus :data:`HEADER_ENTRY_BYTES` an entry
(measured: 1,023 empty tables in 11 KB decode to 143 KiB; 64 KiB of strings that are not UTF-8
in 1,023 entries to 259 KiB). A configuration whose worst case does not fit the memory limit
stops start-up with one line naming the settings.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from consumer.amqp.field_table import MAX_HEADER_ENTRIES
from consumer.errors import ConfigError

__all__ = [
    "BATCH_BYTES",
    "HEADER_ENTRY_BYTES",
    "HEADER_EXPANSION",
    "KEEP_PARSED_BYTES",
    "MemoryBudget",
    "check_memory_budget",
    "check_queue_budgets",
    "container_memory_limit",
    "header_bytes",
    "worst_case",
    "worst_case_of_queues",
]

BASE_BYTES = 96 * 1024 * 1024
"""The process at rest (about 62 MB measured) with room to spare."""
PARSED_EXPANSION = 20
KEEP_PARSED_BYTES = 8 * 1024
BATCH_BYTES = 1024 * 1024
HEADER_EXPANSION = 2
HEADER_ENTRY_BYTES = 160

_CGROUP_LIMITS = (
    Path("/sys/fs/cgroup/memory.max"),  # cgroup v2
    Path("/sys/fs/cgroup/memory/memory.limit_in_bytes"),  # cgroup v1
)
_NO_LIMIT = 1 << 60  # cgroup v1 says "no limit" with a huge number


@dataclass(frozen=True, slots=True)
class MemoryBudget:
    """The settings that decide how much deliveries can take, and the limit to fit (None: the
    container's, if it has one)."""

    prefetch: int
    max_body_bytes: int
    workers: int
    limit: int | None = None
    max_header_bytes: int = 64 * 1024


def worst_case(budget: MemoryBudget) -> int:
    """The most memory the settings let deliveries take, in bytes, the process's own included."""
    body = budget.max_body_bytes
    held = budget.prefetch * body
    parsed_while_held = budget.prefetch * min(body, KEEP_PARSED_BYTES) * PARSED_EXPANSION
    being_applied = budget.workers * max(body, BATCH_BYTES) * PARSED_EXPANSION
    return (
        BASE_BYTES
        + held
        + parsed_while_held
        + being_applied
        + budget.prefetch * header_bytes(budget.max_header_bytes)
    )


def header_bytes(max_header_bytes: int) -> int:
    """The most a held delivery's decoded headers can take (module docstring)."""
    return max_header_bytes * HEADER_EXPANSION + MAX_HEADER_ENTRIES * HEADER_ENTRY_BYTES


def container_memory_limit(paths: tuple[Path, ...] = _CGROUP_LIMITS) -> int | None:
    """The memory limit of the container the process runs in (cgroup), if it has one."""
    for path in paths:
        try:
            text = path.read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < _NO_LIMIT:
            return int(text)
        return None
    return None


def check_memory_budget(budget: MemoryBudget, container: int | None = None) -> None:
    """Raise :class:`ConfigError` if the worst case does not fit the limit (``budget.limit``,
    ``CONSUMER_MEMORY_LIMIT``, else ``container``'s, read from the cgroup when not given; nothing
    to check without either)."""
    limit = budget.limit or (container if container is not None else container_memory_limit())
    if limit is None:
        return
    needed = worst_case(budget)
    if needed > limit:
        source = "CONSUMER_MEMORY_LIMIT" if budget.limit else "the container's limit"
        raise ConfigError(
            f"CONSUMER_PREFETCH ({budget.prefetch}) x CONSUMER_MAX_BODY_BYTES "
            f"({budget.max_body_bytes}) with {budget.workers} workers and "
            f"CONSUMER_MAX_HEADER_BYTES ({budget.max_header_bytes}) "
            f"could take {_mib(needed)} of memory, more than {source} ({_mib(limit)}): lower "
            "CONSUMER_PREFETCH, CONSUMER_MAX_BODY_BYTES or CONSUMER_MAX_HEADER_BYTES"
        )


def worst_case_of_queues(budgets: Iterable[MemoryBudget]) -> int:
    """The worst case of a queue table's queues in one process: each queue's deliveries, and the
    process's own once."""
    return BASE_BYTES + sum(worst_case(budget) - BASE_BYTES for budget in budgets)


def check_queue_budgets(budgets: Mapping[str, MemoryBudget], container: int | None = None) -> None:
    """:func:`check_memory_budget` for the queues of a queue table, by name, served by one
    process: each alone, then all of them together."""
    for budget in budgets.values():
        check_memory_budget(budget, container)
    # CONSUMER_MEMORY_LIMIT is the process's: no queue sets its own.
    configured = next((budget.limit for budget in budgets.values() if budget.limit), None)
    limit = configured or (container if container is not None else container_memory_limit())
    if limit is None or len(budgets) < 2:
        return
    needed = worst_case_of_queues(budgets.values())
    if needed > limit:
        source = "CONSUMER_MEMORY_LIMIT" if configured else "the container's limit"
        raise ConfigError(
            f"the queues {', '.join(budgets)} together could take {_mib(needed)} of memory "
            f"(each its prefetch x CONSUMER_MAX_BODY_BYTES), more than {source} "
            f"({_mib(limit)}): lower some queue's prefetch in CONSUMER_QUEUES_FILE, or run "
            "fewer queues per process (consumer run --queues)"
        )


def _mib(size: int) -> str:
    return f"{size / 1024 / 1024:.0f} MiB"
