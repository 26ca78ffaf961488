"""``python -m bench prune-load``: the service's throughput while receipts are pruned (issue 16).

The service (``python -m consumer run``, as ``make bench``'s service row runs it) drains
``--events`` pre-published events from its work queue, in a database whose receipts table also
holds ``--days`` old daily partitions of ``--rows-per-day`` synthetic receipts each. Per run, in
turn (interleaved, run by run), each of ``--modes``:

- ``without``: nothing else runs;
- ``prune``: ``consumer receipts prune`` (the command) in a loop from the first effect committed
  to the last, each round given a ``CONSUMER_RECEIPT_RETENTION`` that just reaches the oldest old
  partition left, so every round drops one (a real drop: its files, its lock on ``receipts``)
  until they are gone;
- ``dry-run``: the same loop with ``--dry-run``: the command's own cost (an interpreter starting
  on the same two cores, its connection, the listing) without any drop, to tell the two apart;
- ``round``: the same rounds without the command: :class:`consumer.db.pruning.ReceiptPruner` (what
  the service runs every ``CONSUMER_RECEIPT_PRUNE_INTERVAL``) on a connection of the harness.

Each loop starts a round every ``--every`` seconds (1), or at once when the one before took longer
(the command does, here: an interpreter start).

The old partitions are within the service's own retention (so its start-up round leaves them)
and at least a partition plus the margin old (so a retention reaching them is a valid setting).
Every run's database is a copy (``CREATE DATABASE ... TEMPLATE``) of one made once: migrated,
stocked, the old partitions filled. Figures are medians of ``--runs``; the ratio is prune over
without (goal: at least 0.9).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import time
from collections.abc import AsyncIterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from bench import measure, report
from bench.events import Workload
from bench.infra import BenchError, Infra
from bench.measure import Measurement
from bench.receipts import dropped_partitions, generate
from bench.run import effective_knobs, progress, server_versions, versions
from consumer.config.settings import Settings
from consumer.db.pruning import ReceiptPruner
from consumer.db.retention import ReceiptWindow
from consumer.durations import parse_duration

__all__ = [
    "GOAL",
    "MODES",
    "PruneLoadOptions",
    "Round",
    "retention_reaching",
    "rounds_within",
    "run_prune_load",
    "summarize",
    "table",
]

MODES = ("without", "prune", "dry-run", "round")
GOAL = 0.9
"""Throughput while a prune runs, against without (issue 16)."""
OLD_CONSUMER = "bench_old"
"""Whose the synthetic receipts are (not the service's: its exactly-once check counts its own)."""

# Daily partitions wholly inside the service's retention with two hours to spare (its start-up
# round must not drop them, a run lasts minutes) and ending at least a partition and the margin
# ago (a retention reaching them must be at least that, as the settings require), newest first.
_OLD_PARTITIONS = """
SELECT name, starts, ends FROM consumer_receipt_partitions
WHERE name <> 'receipts_legacy'
  AND starts >= now() - $1::interval + interval '2 hours'
  AND ends <= now() - $2::interval - $3::interval
ORDER BY starts DESC
LIMIT $4
"""
_FILL = """
INSERT INTO receipts (consumer, event_id, type, occurred_at)
SELECT $6::text, gen_random_uuid(), 'inventory.reserve',
       $4::timestamptz + ((i - 1)::float8 / $3) * ($5::timestamptz - $4::timestamptz)
FROM generate_series($1::bigint, $2::bigint) AS i
"""
_LEFT = """
SELECT p.name, p.ends, floor(extract(epoch FROM now() - p.ends))::bigint AS age
FROM consumer_receipt_partitions AS p
WHERE p.name = ANY($1::text[])
ORDER BY p.starts
"""


@dataclass(frozen=True, slots=True)
class PruneLoadOptions:
    events: int
    runs: int
    skus: int
    seed: int
    days: int
    rows_per_day: int
    modes: tuple[str, ...]
    every: float
    service_env: dict[str, str]
    amqp_url: str
    admin_dsn: str
    results_dir: Path
    keep_logs: bool


@dataclass(frozen=True, slots=True)
class Round:
    """One ``consumer receipts prune`` of the loop: when it ran, and what it dropped."""

    started: float
    ended: float
    dropped: int


def retention_reaching(age_s: float) -> str:
    """``CONSUMER_RECEIPT_RETENTION`` for a round that drops a partition whose upper bound is
    ``age_s`` seconds old and nothing newer: whole seconds, rounded down (a partition goes once
    its bound is at least the retention old, and time only adds to its age)."""
    if age_s < 1:
        raise ValueError("the partition must have ended at least a second ago")
    return f"{math.floor(age_s)}s"


def rounds_within(rounds: Sequence[Round], window: Sequence[float] | None) -> dict[str, Any]:
    """The rounds that ran wholly or partly inside the measured window: how many, how many old
    partitions they dropped, and the share of the window a round was running (``busy``)."""
    if not window:
        return {"rounds": 0, "drops": 0, "busy": 0.0}
    first, last = window
    inside = [one for one in rounds if one.started < last and one.ended > first]
    busy = sum(min(one.ended, last) - max(one.started, first) for one in inside)
    return {
        "rounds": len(inside),
        "drops": sum(one.dropped for one in inside),
        "busy": round(busy / (last - first), 3) if last > first else 0.0,
    }


class _PruneLoop:
    """Prune rounds over and over (``mode``: the command, the command with ``--dry-run``, or the
    service's round in this process), from the first effect committed until the drain ends, each
    aimed at the oldest old partition left; one every ``every`` seconds at most."""

    def __init__(
        self,
        infra: Infra,
        service_env: dict[str, str],
        old: list[str],
        *,
        mode: str,
        every: float,
    ) -> None:
        self._infra = infra
        self._service_env = service_env
        self._old = old
        self._mode = mode
        self._every = every
        self.rounds: list[Round] = []

    @contextlib.asynccontextmanager
    async def running(self, dsn: str) -> AsyncIterator[None]:
        stop = asyncio.Event()
        task = asyncio.create_task(self._loop(dsn, stop))
        try:
            yield
        finally:
            stop.set()
            await task

    async def _loop(self, dsn: str, stop: asyncio.Event) -> None:
        conn = await asyncpg.connect(dsn)
        try:
            while not stop.is_set():
                if await conn.fetchval("SELECT EXISTS (SELECT FROM stock_movements)"):
                    break
                await asyncio.sleep(measure.POLL_INTERVAL)
            age: int | None = None
            while not stop.is_set():
                left = await conn.fetch(_LEFT, self._old)
                if left:
                    age = int(left[0]["age"])
                if age is None:
                    raise BenchError("no old partition to aim the prune at")
                started = time.time()
                dropped = await self._round(conn, dsn, retention_reaching(age))
                self.rounds.append(Round(started, time.time(), dropped))
                wait = started + self._every - time.time()
                if wait > 0:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stop.wait(), wait)
        finally:
            await conn.close()

    async def _round(self, conn: asyncpg.Connection[Any], dsn: str, retention: str) -> int:
        """One round with that retention; how many of the old partitions it dropped."""
        if self._mode == "round":
            window = ReceiptWindow(
                retention=parse_duration(retention),
                margin=_setting(self._service_env, "receipt_margin"),
                partition=_setting(self._service_env, "receipt_partition"),
                prune_interval=_setting(self._service_env, "receipt_prune_interval"),
            )
            pruner = ReceiptPruner(
                window,
                max_future_skew=_setting(self._service_env, "max_future_skew"),
                lock_wait=_setting(self._service_env, "receipt_prune_lock_wait"),
            )
            report = await pruner.prune(conn)
            return sum(one.partition in self._old for one in report.dropped)
        env = self._infra.child_env(
            {
                **self._service_env,
                "CONSUMER_DATABASE_URL": dsn,
                "CONSUMER_RECEIPT_RETENTION": retention,
            }
        )
        args = ("receipts", "prune", *(("--dry-run",) if self._mode == "dry-run" else ()))
        output = await self._infra.run_module("consumer", *args, env=env)
        return sum(name in self._old for name in dropped_partitions(output))


async def _template(infra: Infra, workload: Workload, options: PruneLoadOptions) -> dict[str, Any]:
    """The database every run copies: migrated and stocked as ``make bench``'s, plus the old
    partitions, filled. Its DSN must have no connection left when it is copied."""
    name = infra.name("prunetpl")
    dsn = await infra.create_database(name, workload)
    conn = await asyncpg.connect(dsn)
    try:
        found = await conn.fetch(
            _OLD_PARTITIONS,
            _setting(options.service_env, "receipt_retention"),
            _setting(options.service_env, "receipt_partition"),
            _setting(options.service_env, "receipt_margin"),
            options.days,
        )
        if len(found) < options.days:
            raise BenchError(
                f"only {len(found)} partitions fit between the retention and a partition ago; "
                f"--days {options.days} asks for more"
            )
        started = time.perf_counter()
        for row in found:
            await generate(
                conn, _FILL, options.rows_per_day, row["starts"], row["ends"], OLD_CONSUMER
            )
        # Vacuumed once here, so that no copy has autovacuum come for these rows mid-run.
        await conn.execute("VACUUM (ANALYZE) receipts")
        generated = time.perf_counter() - started
        size = await conn.fetchval(
            "SELECT sum(pg_total_relation_size(name::regclass))::bigint"
            " FROM consumer_receipt_partitions WHERE name = ANY($1::text[])",
            [row["name"] for row in found],
        )
    finally:
        await conn.close()
    return {
        "name": name,
        "old_partitions": sorted(row["name"] for row in found),
        "old_rows": options.rows_per_day * len(found),
        "old_size_mb": round(size / 2**20, 1),
        "generate_s": round(generated, 1),
    }


def _setting(service_env: Mapping[str, str], field: str) -> timedelta:
    """A duration setting as the service gets it: --service-env, else the environment, else
    the default."""
    key = f"CONSUMER_{field.upper()}"
    value = service_env.get(key) or os.environ.get(key)
    if value:
        return parse_duration(value)
    default: timedelta = Settings.model_fields[field].default
    return default


async def run_prune_load(options: PruneLoadOptions) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    infra = Infra.start(options.amqp_url, options.admin_dsn, options.results_dir, stamp)
    workload = Workload(options.events, options.skus, options.seed)
    result: dict[str, Any] = {
        "kind": "prune-load",
        "started": stamp,
        "events": options.events,
        "runs": options.runs,
        "skus": options.skus,
        "modes": list(options.modes),
        "settings": {"service": {**effective_knobs(options.service_env), **options.service_env}},
        "versions": {**versions(), **await server_versions(options.amqp_url, options.admin_dsn)},
    }
    measurements: dict[str, list[Measurement]] = {mode: [] for mode in options.modes}
    progress(
        f"prune-load {infra.prefix}: {options.events:,} events x {options.runs} runs of "
        f"{', '.join(options.modes)}; {options.days} old days of {options.rows_per_day:,} receipts"
    )
    try:
        template = await _template(infra, workload, options)
        result["template"] = template
        progress(
            f"template: {template['old_rows']:,} old receipts in {len(template['old_partitions'])}"
            f" partitions ({template['old_size_mb']} MB) in {template['generate_s']} s"
        )
        for run in range(1, options.runs + 1):
            progress(f"run {run}/{options.runs}")
            for mode in options.modes:
                measurements[mode].append(await _one(infra, workload, run, mode, options, template))
    finally:
        await _cleanup(infra)
    result.update(summarize(measurements))
    if options.keep_logs or any(m.error for runs in measurements.values() for m in runs):
        result["logs"] = str(infra.log_dir)
    else:
        shutil.rmtree(infra.log_dir, ignore_errors=True)
    return result


async def _one(
    infra: Infra,
    workload: Workload,
    run: int,
    mode: str,
    options: PruneLoadOptions,
    template: dict[str, Any],
) -> Measurement:
    loop = _PruneLoop(
        infra, options.service_env, template["old_partitions"], mode=mode, every=options.every
    )

    async def action() -> Measurement:
        return await measure.service_throughput(
            infra,
            workload,
            run,
            service_env=options.service_env,
            label=mode.replace("-", ""),
            template=template["name"],
            alongside=None if mode == "without" else loop.running,
        )

    started = time.monotonic()
    try:
        found = await action()
    except BenchError as error:
        found = Measurement("service", run, workload.events, error=str(error))
    found.system = mode
    found.extra["prune_rounds"] = [
        {"started": one.started, "ended": one.ended, "dropped": one.dropped} for one in loop.rounds
    ]
    found.extra["within_window"] = rounds_within(loop.rounds, found.extra.get("window"))
    progress(f"  {mode:<8} run {run}: {_describe(found)} [{time.monotonic() - started:.0f}s]")
    return found


def _describe(found: Measurement) -> str:
    if found.error:
        return f"FAILED: {found.error.splitlines()[0][:300]}"
    within = found.extra["within_window"]
    rate = f"{found.rate:,.0f}/s" if found.rate else "no rate"
    return (
        f"{rate}, {within['rounds']} prune rounds ({within['busy']:.0%} of the window) and "
        f"{within['drops']} drops in it"
    )


def summarize(measurements: dict[str, list[Measurement]]) -> dict[str, Any]:
    modes = {mode: report.summarize_system(runs) for mode, runs in measurements.items()}
    without = _median(modes.get("without"))
    ratios = {
        f"{mode}_over_without": report.over(_median(summary), without)
        for mode, summary in modes.items()
        if mode != "without"
    }
    prune = ratios.get("prune_over_without")
    return {
        "modes_summary": modes,
        "ratios": ratios,
        "goal": GOAL,
        "goal_met": None if prune is None else prune >= GOAL,
    }


def _median(summary: dict[str, Any] | None) -> float | None:
    if summary is None or summary["rate"] is None:
        return None
    return float(summary["rate"]["median"])


async def _cleanup(infra: Infra) -> None:
    for step in (infra.sweep_broker, infra.drop_all_databases):
        try:
            await step()
        except (BenchError, OSError, asyncpg.PostgresError) as error:
            progress(f"cleanup failed: {error}")


def table(result: dict[str, Any]) -> str:
    template = result["template"]
    lines = [
        f"service draining {result['events']:,} events, medians of {result['runs']} interleaved "
        f"runs; receipts also hold {template['old_rows']:,} old ones in "
        f"{len(template['old_partitions'])} daily partitions ({template['old_size_mb']} MB)",
        f"{'mode':<10}{'msg/s':>9}{'min - max':>18}  {'rounds / drops / busy, per run':<34}"
        f"{'sut CPU ms/msg':>15}{'pg CPU ms/msg':>15}",
    ]
    for mode, summary in result["modes_summary"].items():
        rate = summary["rate"]
        per_run = " ".join(
            "{rounds}/{drops}/{busy:.0%}".format(**run["extra"]["within_window"])
            for run in summary["runs"]
            if "within_window" in run["extra"]
        )
        cpu = summary["cpu_ms_per_msg"]
        lines.append(
            f"{mode:<10}{report._num(rate and rate['median']):>9}{report._range(rate):>18}"
            f"  {per_run:<34}"
            f"{report._num(cpu.get('sut'), 3):>15}{report._num(cpu.get('postgres'), 3):>15}"
        )
        for error in summary["errors"]:
            lines.append(f"    ! {error.splitlines()[0][:200]}")
    verdict = {True: "met", False: "not met", None: "-"}[result["goal_met"]]
    ratios = ", ".join(
        f"{key.replace('_', ' ')} {report._num(value, 3)}"
        for key, value in result["ratios"].items()
    )
    lines.append(f"{ratios} (goal: prune over without >= {result['goal']}: {verdict})")
    return "\n".join(lines)


def parse_modes(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    if not chosen or any(part not in MODES for part in chosen):
        raise ValueError(f"choose from {','.join(MODES)}")
    return tuple(mode for mode in MODES if mode in chosen)
