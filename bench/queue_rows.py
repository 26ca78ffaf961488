"""The figures behind the README's queue table (issue 32): a per-event handler's throughput and
p99 at prefetch 1, 10 and 400, awaiting 0, 5 ms or 2 s per event.

    make bench-queues                                   # every cell once, a few minutes
    .venv/bin/python -m bench.queue_rows --runs 2 --prefetches 1,400 --waits 0,5ms

Each cell runs the service (``CONSUMER_HANDLERS=bench.handlers``: ``inventory.reserve``, the
handler awaits the wait, then one statement) at its defaults but ``CONSUMER_PREFETCH``; the 2 s
handler also gets the report row's long time limit (:data:`LONG_LIMITS`). Two measurements per
cell, the very ones of ``make bench``:

- **throughput**: its service row (:func:`bench.measure.service_throughput`): the cell's events
  published and confirmed first, the service started, the rate from the first effect committed to
  the last; exactly once checked.
- **p99**: its latency run (:func:`bench.measure.latency`): the service started on an empty queue,
  fed by the paced publisher at :data:`LATENCY_SHARE` of the rate just measured for
  :data:`LATENCY_SECONDS`, publish -> commit (the commit clock); ``kept up`` says whether it
  sustained that rate (backlog at the end at most half a second of publishing).

The events per cell (:data:`EVENTS`, ``--scale``) are sized so that each measurement takes about
ten seconds on the shared two cores. Cells and runs are interleaved (run 1 of every cell, then
run 2). Results go to ``bench/results/queue-rows-<time>.{json,txt}``; the last stdout line is the
summary.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import shutil
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from bench import measure, report
from bench.cli import _common, _positive_ints, _service_env
from bench.events import Workload
from bench.infra import BenchError, Infra
from bench.measure import Measurement
from bench.run import _cleanup, _guarded, machine, progress

__all__ = [
    "EVENTS",
    "LATENCY_SECONDS",
    "LATENCY_SHARE",
    "PREFETCHES",
    "WAITS",
    "cell_env",
    "cell_events",
    "kept_up",
    "paced_rate",
    "queue_row_lines",
    "summarize_cell",
]

PREFETCHES = (1, 10, 400)
WAITS = {"0": "db", "5ms": "io5", "2s": "io2s"}
"""Each handler wait and the :mod:`bench.handlers` mode that awaits it."""
WAIT_SECONDS = {"0": 0.0, "5ms": 0.005, "2s": 2.0}

EVENTS: dict[str, dict[int, int]] = {
    "0": {1: 800, 10: 2000, 400: 4000},
    "5ms": {1: 500, 10: 2000, 400: 3000},
    "2s": {1: 6, 10: 24, 400: 24},
}
"""Throughput events per cell at ``--scale 1``: ten to twenty seconds each on the shared two cores
under load (a 2 s handler does 0.5 events a second at prefetch 1, two with the pool's four
workers); on a quiet machine the fast cells end sooner."""

LATENCY_SHARE = 0.5
"""The latency run publishes at this share of the cell's measured throughput: a load it can
take, so that its p99 is the handling's, not a queue's."""

LATENCY_CAP = 1000.0
"""Never faster than this (the paced publisher's own cost grows with the rate)."""

LATENCY_SECONDS = {"0": 6.0, "5ms": 6.0, "2s": 20.0}
LATENCY_WARMUP = 1.0

LONG_LIMITS = {"CONSUMER_HANDLER_TIMEOUT": "1m", "CONSUMER_HARD_TIMEOUT": "2m"}
"""The report row's setting: a time limit well above the handler's time."""


def cell_events(wait: str, prefetch: int, scale: float) -> int:
    """The cell's throughput events: :data:`EVENTS` scaled, at least two (a rate needs a first
    and a last commit)."""
    return max(2, round(EVENTS[wait].get(prefetch, EVENTS[wait][max(EVENTS[wait])]) * scale))


def paced_rate(throughput: float | None) -> float | None:
    """The latency run's rate: :data:`LATENCY_SHARE` of the throughput, at most
    :data:`LATENCY_CAP`; None without a throughput (no latency run)."""
    if not throughput:
        return None
    return min(LATENCY_CAP, throughput * LATENCY_SHARE)


def cell_env(service_env: Mapping[str, str], wait: str, prefetch: int) -> dict[str, str]:
    """The service's settings for a cell: the handler, the prefetch, and for the long handler
    the long time limit."""
    env = {
        **service_env,
        "CONSUMER_HANDLERS": "bench.handlers",
        "BENCH_HANDLER": WAITS[wait],
        "CONSUMER_PREFETCH": str(prefetch),
    }
    if wait == "2s":
        env = {**LONG_LIMITS, **env}
    return env


def kept_up(rate: float, backlog: float | None, wait: str) -> bool | None:
    """Whether a paced run kept up: its backlog when publishing stopped at most what it takes in
    :data:`~bench.report.SUSTAIN_BACKLOG_SECONDS` and one handler's wait, rounded up (``make
    bench``'s rule, which allows no event in flight at a rate under two a second: a 2 s handler
    that keeps up still has the last event in hand)."""
    if backlog is None:
        return None
    allowed = math.ceil(rate * (report.SUSTAIN_BACKLOG_SECONDS + WAIT_SECONDS[wait]))
    return backlog <= allowed


def summarize_cell(
    wait: str,
    prefetch: int,
    throughput: Sequence[Measurement],
    latency: Sequence[Measurement],
) -> dict[str, Any]:
    """One cell's medians: throughput (and the workers and batch size the service ended at),
    and the latency runs' p50/p99 at their paced rate, whether they kept up."""
    paced = report.spread(run.rate for run in latency if run.error is None)
    summary = report.summarize_latency(paced["median"] if paced else 0.0, latency)
    return {
        "wait": wait,
        "prefetch": prefetch,
        "events": next((run.events for run in throughput), 0),
        "throughput": report.spread(run.rate for run in throughput),
        "chose": [
            {"workers": run.extra.get("workers"), "batch_size": run.extra.get("batch_size")}
            for run in throughput
            if run.error is None
        ],
        "machine_pct": report.spread(run.cpu.get("machine") for run in throughput),
        "paced_rate": paced,
        "p50_ms": summary["p50_ms"],
        "p99_ms": summary["p99_ms"],
        "samples": summary["samples"],
        "kept_up": kept_up(paced["median"], _median(summary["backlog_at_end"]), wait)
        if paced
        else None,
        "errors": [
            f"{kind} run {run.run}: {run.error}"
            for kind, runs in (("throughput", throughput), ("latency", latency))
            for run in runs
            if run.error
        ],
    }


def _median(stats: Mapping[str, float] | None) -> float | None:
    return None if stats is None else stats["median"]


def _chose(cell: Mapping[str, Any]) -> str:
    return ", ".join(
        f"w{'-' if c['workers'] is None else int(c['workers'])} "
        f"b{'-' if c['batch_size'] is None else int(c['batch_size'])}"
        for c in cell["chose"]
    )


def queue_row_lines(cells: Sequence[Mapping[str, Any]], runs: int) -> list[str]:
    """The table: per cell, msg/s, the paced rate, p50 and p99 publish -> commit, kept up, the
    workers and batch size the service ended at, the machine's CPU."""
    kept = {True: "yes", False: "NO", None: "-"}
    lines = [
        f"queue rows (per-event inventory.reserve, service defaults but CONSUMER_PREFETCH; "
        f"medians of {runs}; latency paced at {LATENCY_SHARE:g} x throughput):",
        f"{'wait':<6}{'prefetch':>9}{'events':>8}{'msg/s':>9}{'paced/s':>9}{'p50 ms':>9}"
        f"{'p99 ms':>9}{'kept up':>9}{'machine %':>11}  ended at",
    ]
    for cell in cells:
        lines.append(
            f"{cell['wait']:<6}{cell['prefetch']:>9}{cell['events']:>8}"
            f"{report._num(_median(cell['throughput']), 1):>9}"
            f"{report._num(_median(cell['paced_rate']), 1):>9}"
            f"{report._num(_median(cell['p50_ms']), 1):>9}"
            f"{report._num(_median(cell['p99_ms']), 1):>9}"
            f"{kept[cell['kept_up']]:>9}"
            f"{report._num(_median(cell['machine_pct'])):>11}  {_chose(cell)}"
        )
        for error in cell["errors"]:
            lines.append(f"    ! {error.splitlines()[0][:200]}")
    return lines


@dataclass(frozen=True)
class QueueRowsOptions:
    prefetches: tuple[int, ...]
    waits: tuple[str, ...]
    runs: int
    scale: float
    skus: int
    seed: int
    amqp_url: str
    admin_dsn: str
    results_dir: Path
    keep_logs: bool
    service_env: dict[str, str] = field(default_factory=dict)


async def _cell_run(
    infra: Infra, options: QueueRowsOptions, wait: str, prefetch: int, run: int
) -> tuple[Measurement, Measurement]:
    env = cell_env(options.service_env, wait, prefetch)
    events = cell_events(wait, prefetch, options.scale)
    workload = Workload(events, options.skus, options.seed)
    label = f"q{WAITS[wait]}p{prefetch}"

    async def throughput() -> Measurement:
        return await measure.service_throughput(
            infra, workload, run, service_env=env, label=f"{label}t"
        )

    drained = await _guarded(f"{wait}@{prefetch}", run, events, throughput)
    rate = paced_rate(drained.rate)
    if rate is None:
        return drained, Measurement("service", run, 0, error="no throughput to pace at")

    async def paced() -> Measurement:
        return await measure.latency(
            infra,
            workload,
            run,
            system="service",
            rate=rate,
            seconds=LATENCY_SECONDS[wait],
            warmup=LATENCY_WARMUP,
            service_env=env,
            prefetch=prefetch,
            label=f"{label}l{run}",
        )

    return drained, await _guarded(f"{wait}@{prefetch} {rate:.3g}/s", run, 0, paced)


async def run_queue_rows(options: QueueRowsOptions) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    infra = Infra.start(options.amqp_url, options.admin_dsn, options.results_dir, stamp)
    cells = [(wait, prefetch) for wait in options.waits for prefetch in options.prefetches]
    measured: dict[tuple[str, int], tuple[list[Measurement], list[Measurement]]] = {
        cell: ([], []) for cell in cells
    }
    started = machine()
    progress(f"queue rows {infra.prefix}: {len(cells)} cells x {options.runs} runs; {started}")
    began = time.monotonic()
    try:
        for run in range(1, options.runs + 1):
            for wait, prefetch in cells:
                drained, paced = await _cell_run(infra, options, wait, prefetch, run)
                measured[wait, prefetch][0].append(drained)
                measured[wait, prefetch][1].append(paced)
    finally:
        await _cleanup(infra)
    rows = [summarize_cell(wait, prefetch, *measured[wait, prefetch]) for wait, prefetch in cells]
    result: dict[str, Any] = {
        "kind": "queue-rows",
        "started": stamp,
        "runs": options.runs,
        "scale": options.scale,
        "machine": started,
        "load_average_at_end": [round(value, 2) for value in os.getloadavg()],
        "minutes": round((time.monotonic() - began) / 60, 1),
        "settings": {
            "service_env": options.service_env,
            "long_limits_for_2s": LONG_LIMITS,
            "latency_share": LATENCY_SHARE,
            "latency_seconds": LATENCY_SECONDS,
        },
        "cells": rows,
        "runs_detail": {
            f"{wait}@{prefetch}": {
                "throughput": [asdict(run) for run in measured[wait, prefetch][0]],
                "latency": [asdict(run) for run in measured[wait, prefetch][1]],
            }
            for wait, prefetch in cells
        },
    }
    if options.keep_logs or any(row["errors"] for row in rows):
        result["logs"] = str(infra.log_dir)
    else:
        shutil.rmtree(infra.log_dir, ignore_errors=True)
    return result


def table(result: Mapping[str, Any]) -> str:
    load = " ".join(f"{value:.2f}" for value in result["load_average_at_end"])
    return "\n".join(
        [
            f"queue rows {result['started']}: {result['machine']}; load average {load} at end; "
            f"{result['minutes']} min",
            *queue_row_lines(result["cells"], result["runs"]),
        ]
    )


def _waits(text: str) -> tuple[str, ...]:
    waits = tuple(part.strip() for part in text.split(",") if part.strip())
    if not waits or any(wait not in WAITS for wait in waits):
        raise argparse.ArgumentTypeError(f"choose among {','.join(WAITS)}")
    return waits


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m bench.queue_rows", description=(__doc__ or "").split("\n\n")[0]
    )
    parser.add_argument("--prefetches", type=_positive_ints, default=PREFETCHES)
    parser.add_argument("--waits", type=_waits, default=tuple(WAITS), help="subset of 0,5ms,2s")
    parser.add_argument("--runs", type=int, default=1)
    parser.add_argument("--scale", type=float, default=1.0, help="of every cell's events")
    _common(parser)
    arguments = parser.parse_args(argv)
    if arguments.runs < 1 or arguments.scale <= 0:
        raise SystemExit("--runs must be at least 1 and --scale above 0")
    options = QueueRowsOptions(
        prefetches=arguments.prefetches,
        waits=arguments.waits,
        runs=arguments.runs,
        scale=arguments.scale,
        skus=arguments.skus,
        seed=arguments.seed,
        amqp_url=arguments.amqp_url,
        admin_dsn=arguments.admin_dsn,
        results_dir=arguments.results_dir,
        keep_logs=arguments.keep_logs,
        service_env=_service_env(arguments.service_env),
    )
    try:
        result = asyncio.run(run_queue_rows(options))
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    summary = {key: value for key, value in result.items() if key != "runs_detail"}
    report.publish(result, table(result), options.results_dir, summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
