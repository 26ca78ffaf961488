"""The queue table: several work queues in one service, each tuned for its kind of work.

``CONSUMER_QUEUES_FILE`` names a TOML file (read with :mod:`tomllib`)::

    [queues.sms]
    types = ["notification.sms"]
    prefetch = 400

    [queues.report]
    types = ["report.build"]
    prefetch = 1
    handler_timeout = "10m"
    hard_timeout = "11m"

Each ``[queues.<name>]`` lists the event types it takes (``types``) and may override, for that
queue only, the settings :data:`OVERRIDES` names; every other setting is the service's. Each
event type belongs to exactly one queue, and every handler's type to one queue. ``shards``, the
queue's own and no setting, splits its work queue into that many by key
(:mod:`topology.plan`).

Parsing is pure: no broker, no database. Every problem raises
:class:`~consumer.errors.QueueTableError` whose message is the one line start-up prints, naming
the file, the queue and the key; a bad value is described by the setting's own check, as the
environment variable's would be (:func:`consumer.config.setting_errors.settings_problems`).
Without the file the service has one queue, :meth:`QueueTable.default`, with today's names.
"""

from __future__ import annotations

import difflib
import re
import tomllib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from datetime import timedelta
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from consumer.config.setting_errors import settings_problems
from consumer.config.setting_values import positive_duration
from consumer.config.settings import ACK_TIMEOUT_MARGIN, Settings
from consumer.envelope import EVENT_TYPE_PATTERN
from consumer.errors import QueueTableError
from topology.durations import format_duration
from topology.plan import MAX_SHARDS

__all__ = [
    "ACK_TIMEOUT_MARGIN",
    "BROKER_ACK_TIMEOUT",
    "MAX_SHARDS",
    "OVERRIDES",
    "QUEUE_NAME",
    "QueueSpec",
    "QueueTable",
    "read_queue_table",
]

OVERRIDES = (
    "prefetch",
    "workers",
    "batch_size",
    "batch_wait",
    "handler_timeout",
    "hard_timeout",
    "retry_delays",
    "delivery_limit",
    "work_queue_version",
    "db_pool_size",
    "receipt_retention",
    "ack_timeout",
)
"""The keys a queue may set: each the setting of that name (``prefetch`` is
``CONSUMER_PREFETCH``), for this queue alone.

``receipt_retention`` is the queue's own expiry check (an event older than it less
``CONSUMER_RECEIPT_MARGIN`` is dead-lettered ``expired``); the receipts stay one table, whose
partitions go once past the longest retention of the table's queues
(:attr:`QueueTable.receipt_retention`). Not a table per queue: an event is deduplicated by its id
whichever queue it came through (a type moved between queues, a replay), so every receipt must be
found by every queue for as long as any queue may apply an event that old; the longest retention
keeps that true, and a shorter one still refuses older events sooner.

``ack_timeout`` is the queue's delivery acknowledgement timeout, which the topology sets on its
work queue (RabbitMQ 3.12 and later, :mod:`topology.broker_support`)."""

_KEYS = ("types", "shards", *OVERRIDES)

BROKER_ACK_TIMEOUT = timedelta(minutes=30)
"""RabbitMQ's delivery acknowledgement timeout (``consumer_timeout``) by default: a delivery held
unacknowledged longer closes its channel, and every delivery on it goes back. The service's
``broker_ack_timeout`` declares the broker's own."""

QUEUE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,49}$")
"""A queue's name: a part of its broker names (``<CONSUMER_NAME>.<queue>.work``), so no dot
(``a.retry`` would read as queue ``a``'s retry exchange)."""

_EVENT_TYPE = re.compile(EVENT_TYPE_PATTERN)


@dataclass(frozen=True, slots=True)
class QueueSpec:
    """One row of the table: the queue's name, its event types and its settings (the service's,
    with the row's overrides)."""

    name: str | None
    """``None`` for the queue-less default: the service's work queue keeps today's names."""
    types: tuple[str, ...]
    settings: Settings
    overrides: tuple[str, ...] = ()
    """The keys this row sets (the others are the service's settings)."""
    shards: int = 1
    """How many work queues the queue's events are spread over by key (1: one work queue,
    with today's names)."""
    only_shards: tuple[int, ...] = ()
    """The shards this process consumes (``consumer run --shards``); empty: every one."""

    @property
    def consumed_shards(self) -> tuple[int, ...]:
        """The shards (counted from 1) this process consumes of a sharded queue."""
        return self.only_shards or tuple(range(1, self.shards + 1))

    @property
    def label(self) -> str:
        """The name metrics and logs give this queue: the default is the service's name."""
        return self.name if self.name is not None else self.settings.name


@dataclass(frozen=True, slots=True)
class QueueTable:
    """Every queue of the service, in the file's order."""

    queues: tuple[QueueSpec, ...]
    path: Path | None = None
    whole_retention: timedelta | None = None
    """A subset's: the longest receipt retention of the whole table it was taken from."""

    @classmethod
    def default(cls, settings: Settings, event_types: Iterable[str]) -> QueueTable:
        """No table: one queue taking every handler's type, under the service's own names."""
        return cls((QueueSpec(None, tuple(sorted(event_types)), settings),))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(queue.label for queue in self.queues)

    @property
    def sharded(self) -> tuple[QueueSpec, ...]:
        """The queues with more than one shard."""
        return tuple(queue for queue in self.queues if queue.shards > 1)

    @property
    def receipt_retention(self) -> timedelta:
        """How long the receipts (one table) are kept: the longest retention of the table's
        queues, of the whole table for a subset (``--queues``): another deployment's queue may
        still apply events that old, and must find their receipts."""
        longest = max(queue.settings.receipt_retention for queue in self.queues)
        if self.whole_retention is not None:
            return max(longest, self.whole_retention)
        return longest

    def queue_of(self, event_type: str) -> QueueSpec:
        """The queue an event type is routed to (``KeyError`` for a type in none)."""
        for queue in self.queues:
            if event_type in queue.types:
                return queue
        raise KeyError(event_type)

    def subset(self, names: Sequence[str], flag: str = "--queues") -> QueueTable:
        """The queues ``consumer run --queues a,b`` runs; an unknown name is an error, which
        names the command's ``flag``."""
        known = {queue.label: queue for queue in self.queues}
        if not names:
            raise QueueTableError(f"{flag} names no queue of {self._where()}")
        unknown = [name for name in names if name not in known]
        if unknown:
            raise QueueTableError(
                f"{flag}: no queue {', '.join(map(repr, unknown))} in "
                f"{self._where()} (it has {', '.join(known)})"
            )
        wanted = set(names)
        return QueueTable(
            tuple(q for q in self.queues if q.label in wanted), self.path, self.receipt_retention
        )

    def shard_subset(self, shards: Sequence[int]) -> QueueTable:
        """The table ``consumer run --shards 1,3`` runs: of each sharded queue, only those shards
        (so that replicas split them); the unsharded queues whole. A shard beyond a sharded
        queue's count, or a table with no sharded queue, is an error."""
        if not self.sharded:
            raise QueueTableError(f"--shards: {self._where()} has no sharded queue")
        if not shards:
            raise QueueTableError("--shards names no shard")
        wanted = tuple(sorted(set(shards)))
        for queue in self.sharded:
            beyond = [shard for shard in wanted if not 1 <= shard <= queue.shards]
            if beyond:
                raise QueueTableError(
                    f"--shards: queue {queue.label} has shards 1 to {queue.shards}, "
                    f"not {', '.join(map(str, beyond))}"
                )
        return replace(
            self,
            queues=tuple(
                replace(queue, only_shards=wanted) if queue.shards > 1 else queue
                for queue in self.queues
            ),
        )

    def check_shared_waits(self) -> None:
        """The queues of one process share the isolation gate (crash attribution): a batch taken
        from one queue's inbox waits, unacknowledged, while another queue applies a delivery
        alone, up to that queue's ``hard_timeout``, and then takes its own. A queue whose
        acknowledgement timeout (its ``ack_timeout``, else the broker's) cannot cover both plus
        :data:`ACK_TIMEOUT_MARGIN` would have its channel closed by the broker behind a long
        neighbour: refused, for the queues this process runs (``--queues`` splits them)."""
        if len(self.queues) < 2:
            return
        for queue in self.queues:
            others = [q for q in self.queues if q is not queue]
            longest = max(others, key=lambda q: q.settings.hard_timeout)
            own = queue.settings
            timeout = own.ack_timeout if own.ack_timeout is not None else own.broker_ack_timeout
            held = longest.settings.hard_timeout + own.hard_timeout
            if held + ACK_TIMEOUT_MARGIN > timeout:
                raise self._error(
                    queue.name,
                    "hard_timeout",
                    f"a delivery of this queue can be held {format_duration(held)} (behind queue "
                    f"{longest.label}'s delivery applied alone, hard_timeout "
                    f"{format_duration(longest.settings.hard_timeout)}, then its own "
                    f"{format_duration(own.hard_timeout)}), near its acknowledgement timeout "
                    f"({format_duration(timeout)}): run {queue.label} and {longest.label} in "
                    f"processes of their own (consumer run --queues {longest.label}), or give "
                    f"{queue.label} a longer ack_timeout, or shorten a hard_timeout",
                )

    def check_handlers(self, event_types: Iterable[str]) -> None:
        """Every type in the table has a handler, and every handler's type is in a queue."""
        handled = set(event_types)
        for queue in self.queues:
            for event_type in queue.types:
                if event_type not in handled:
                    raise self._error(
                        queue.name,
                        "types",
                        f"{event_type!r} has no handler in CONSUMER_HANDLERS",
                    )
        listed = {event_type for queue in self.queues for event_type in queue.types}
        orphans = sorted(handled - listed)
        if orphans:
            raise self._error(
                None,
                "types",
                f"no queue takes {', '.join(map(repr, orphans))}, which CONSUMER_HANDLERS "
                "handles: add each to the types of one queue",
            )

    def _where(self) -> str:
        return f"queue table {self.path}" if self.path is not None else "the queue table"

    def _error(self, queue: str | None, key: str | None, message: str) -> QueueTableError:
        return _error(self.path, queue, key, message)


def _error(path: Path | None, queue: str | None, key: str | None, message: str) -> QueueTableError:
    where = [f"invalid queue table {path}"]
    if queue is not None:
        where.append(f"queue {queue}")
    if key is not None:
        where.append(key)
    return QueueTableError(": ".join([*where, message]))


def read_queue_table(path: Path, settings: Settings) -> QueueTable:
    """The table in ``path``, each queue's settings the service's ``settings`` with the row's
    overrides; every problem a :class:`~consumer.errors.QueueTableError`."""
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as error:
        raise _error(path, None, None, f"cannot read it: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise _error(path, None, None, "is not UTF-8 text") from None
    try:
        document = tomllib.loads(text)
    except tomllib.TOMLDecodeError as error:
        raise _error(path, None, None, f"is not TOML: {error}") from None
    return parse_queue_table(document, settings, path)


def parse_queue_table(
    document: Mapping[str, Any], settings: Settings, path: Path | None = None
) -> QueueTable:
    """The table from a parsed TOML document (``read_queue_table`` without the file)."""
    for key in document:
        if key != "queues":
            raise _error(path, None, key, "unknown key (the file holds [queues.<name>] tables)")
    rows = document.get("queues")
    if not isinstance(rows, Mapping) or not rows:
        raise _error(path, None, "queues", "no queue: add a [queues.<name>] table")
    queues = [_queue(path, name, row, settings) for name, row in rows.items()]
    owner: dict[str, str] = {}
    for queue in queues:
        assert queue.name is not None
        for event_type in queue.types:
            if event_type in owner:
                raise _error(
                    path,
                    queue.name,
                    "types",
                    f"{event_type!r} is also in queue {owner[event_type]}: "
                    "each event type belongs to one queue",
                )
            owner[event_type] = queue.name
    return QueueTable(tuple(queues), path)


def _queue(path: Path | None, name: str, row: object, settings: Settings) -> QueueSpec:
    if not QUEUE_NAME.match(name):
        raise _error(
            path, name, None, "is not a usable queue name (letters, digits, '_', '-'; at most 50)"
        )
    if not isinstance(row, Mapping):
        raise _error(path, name, None, "must be a table ([queues.<name>])")
    for key in row:
        if key not in _KEYS:
            nearest = difflib.get_close_matches(key, _KEYS, n=1, cutoff=0.6)
            hint = f"did you mean {nearest[0]}?" if nearest else f"known: {', '.join(_KEYS)}"
            raise _error(path, name, key, f"unknown key ({hint})")
    types = _types(path, name, row.get("types"))
    shards = _shards(path, name, row.get("shards", 1))
    overrides = {key: row[key] for key in OVERRIDES if key in row}
    for key, value in overrides.items():
        # pydantic would read true as 1: no setting here is a switch.
        if isinstance(value, bool):
            raise _error(path, name, key, f"is not a switch (got {str(value).lower()})")
    _check_retention(path, name, settings, overrides.get("receipt_retention"))
    own = _settings(path, name, settings, overrides)
    _check_ack_timeout(path, name, own)
    return QueueSpec(name, types, own, tuple(overrides), shards)


def _shards(path: Path | None, queue: str, value: object) -> int:
    # bool is an int to Python: true is no shard count.
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_SHARDS:
        shown = str(value).lower() if isinstance(value, bool) else repr(value)
        raise _error(
            path, queue, "shards", f"must be a whole number from 1 to {MAX_SHARDS} (got {shown})"
        )
    return value


def _check_retention(
    path: Path | None, queue: str, settings: Settings, value: object | None
) -> None:
    """A queue's ``receipt_retention`` against the service's margin and partition, named as the
    key the row sets (the settings' own checks would name the margin and the partition)."""
    if value is None:
        return
    try:
        retention = positive_duration(value)
    except ValueError:
        return  # the setting's own check describes it
    margin, partition = settings.receipt_margin, settings.receipt_partition
    if retention <= margin or retention < partition:
        raise _error(
            path,
            queue,
            "receipt_retention",
            f"{format_duration(retention)} must be longer than CONSUMER_RECEIPT_MARGIN "
            f"({format_duration(margin)}) and at least CONSUMER_RECEIPT_PARTITION "
            f"({format_duration(partition)})",
        )


def _check_ack_timeout(path: Path | None, queue: str, settings: Settings) -> None:
    """A time limit that lets a delivery be held near the broker's acknowledgement timeout would
    have the broker close the queue's channel under its long work, over and over. The queue's own
    ``ack_timeout`` is checked against its limits by the settings."""
    if settings.ack_timeout is not None:
        return
    broker = settings.broker_ack_timeout
    limit = broker - ACK_TIMEOUT_MARGIN
    for key in ("handler_timeout", "hard_timeout"):
        value: timedelta = getattr(settings, key)
        if value > limit:
            default = broker == BROKER_ACK_TIMEOUT
            raise _error(
                path,
                queue,
                key,
                f"{format_duration(value)} comes near RabbitMQ's delivery acknowledgement timeout "
                f"(consumer_timeout, {format_duration(broker)}"
                f"{' by default' if default else ', CONSUMER_BROKER_ACK_TIMEOUT'}), which "
                f"closes the channel of a delivery held longer: keep it at most "
                f"{format_duration(limit)}, or give the queue an ack_timeout (RabbitMQ 3.12 and "
                "later), or take longer work in a short handler that publishes its completion "
                "later",
            )


def _types(path: Path | None, queue: str, value: object) -> tuple[str, ...]:
    if value is None:
        raise _error(path, queue, "types", "is missing: list the event types this queue takes")
    if not isinstance(value, list) or not value:
        raise _error(path, queue, "types", "must be a non-empty list of event types")
    seen: list[str] = []
    for event_type in value:
        if not isinstance(event_type, str) or not _EVENT_TYPE.match(event_type):
            raise _error(path, queue, "types", f"{event_type!r} is not an event type")
        if event_type in seen:
            raise _error(path, queue, "types", f"lists {event_type!r} twice")
        seen.append(event_type)
    return tuple(seen)


def _settings(
    path: Path | None, queue: str, settings: Settings, overrides: Mapping[str, object]
) -> Settings:
    """The service's settings with the row's values, checked by the settings' own validators
    (the cross-setting ones too: a queue's ``workers`` above its pool is refused)."""
    if not overrides:
        return settings
    values = settings.model_dump()
    # The URLs are in hand already; read from their files again they would count as set twice.
    values.update(amqp_url_file=None, database_url_file=None, **overrides)
    try:
        # model_validate, not the constructor: the environment is not read again.
        return Settings.model_validate(values)
    except ValidationError as error:
        problems = settings_problems(error, lambda field: field)
        raise _error(path, queue, None, "; ".join(problems)) from None
