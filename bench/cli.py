"""``python -m bench {run,soak,receipts,prune-load,dlq}``: the comparison benchmark, the memory
soak, the receipts retention costs, the service's throughput while receipts are pruned and the
dead-letter tools on 100,000 letters."""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

from bench import dlq, handler_rows, handlers, prune_load, receipts, report, soak
from bench.infra import OWNED_SERVICE_ENV, REPO, BenchError
from bench.run import SYSTEMS, BenchOptions, run_bench
from consumer.durations import parse_duration

RESULTS = REPO / "bench" / "results"


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value else default


def _service_env(pairs: Sequence[str]) -> dict[str, str]:
    values = {}
    for pair in pairs:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise SystemExit(f"--service-env {pair!r}: expected KEY=VALUE")
        if key in OWNED_SERVICE_ENV:
            raise SystemExit(f"--service-env {key}: the harness sets it for each run")
        values[key] = value
    return values


def _systems(text: str) -> tuple[str, ...]:
    chosen = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [part for part in chosen if part not in SYSTEMS]
    if unknown or not chosen:
        raise argparse.ArgumentTypeError(f"choose from {','.join(SYSTEMS)}")
    return tuple(system for system in SYSTEMS if system in chosen)


def _numbers(text: str, kind: type[int] | type[float]) -> tuple[Any, ...]:
    try:
        values = tuple(kind(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s") from None
    if not values or min(values) <= 0:
        raise argparse.ArgumentTypeError(f"expected comma-separated {kind.__name__}s above 0")
    return values


def _positive_ints(text: str) -> tuple[int, ...]:
    return _numbers(text, int)


def _positive_numbers(text: str) -> tuple[float, ...]:
    return _numbers(text, float)


def partition_span(text: str) -> timedelta:
    """``--partition``: a duration as ``CONSUMER_RECEIPT_PARTITION`` takes it (whole seconds, at
    least 1s), at most the prune's retention (6d), so that the prune has a partition to drop."""
    try:
        span = parse_duration(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(f"{text!r} {error}") from None
    if span < timedelta(seconds=1) or span.total_seconds() % 1:
        raise argparse.ArgumentTypeError(f"{text!r}: whole seconds, at least 1s")
    if span > receipts.PRUNE_RETENTION:
        raise argparse.ArgumentTypeError(f"{text!r}: at most the prune's retention, 6d")
    return span


def _sized(parser: argparse.ArgumentParser, each: str) -> None:
    """``--events`` and ``--runs``, as ``make bench`` sets them (BENCH_EVENTS, BENCH_RUNS)."""
    parser.add_argument(
        "--events",
        type=int,
        default=_env_int("BENCH_EVENTS", 20_000),
        help=f"events per run and {each} (env BENCH_EVENTS; default 20000)",
    )
    parser.add_argument(
        "--runs",
        type=int,
        default=_env_int("BENCH_RUNS", 3),
        help=f"runs per {each}; figures are medians (env BENCH_RUNS; default 3)",
    )


def _handler_modes(text: str) -> tuple[str, ...]:
    modes = tuple(part.strip() for part in text.split(",") if part.strip())
    unknown = [mode for mode in modes if mode not in handlers.MODES]
    if unknown or not modes:
        raise argparse.ArgumentTypeError(f"choose among {','.join(handlers.MODES)}")
    return modes


def _handler_events(scale: float) -> dict[str, int]:
    return {
        mode: max(1, round(count * scale)) for mode, count in handler_rows.DEFAULT_EVENTS.items()
    }


def _modes(text: str) -> tuple[str, ...]:
    try:
        return prune_load.parse_modes(text)
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--skus", type=int, default=100, help="SKUs the events spread over")
    parser.add_argument("--seed", type=int, default=1, help="seed of the workload")
    parser.add_argument(
        "--service-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="an extra environment variable for the service (repeatable); CONSUMER_PREFETCH, "
        "CONSUMER_DB_POOL_SIZE, CONSUMER_BATCH_SIZE and CONSUMER_BATCH_WAIT are also taken "
        "from the environment",
    )
    parser.add_argument(
        "--amqp-url",
        default=os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    parser.add_argument(
        "--admin-dsn",
        default=os.environ.get("BENCH_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
        help="a database to connect to for CREATE/DROP DATABASE",
    )
    parser.add_argument("--results-dir", type=Path, default=RESULTS)
    parser.add_argument("--keep-logs", action="store_true", help="keep the processes' logs")


def parser() -> argparse.ArgumentParser:
    root = argparse.ArgumentParser(
        prog="python -m bench",
        description="Throughput against Celery, Dramatiq and the broker's and database's limits; "
        "a memory soak.",
    )
    commands = root.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("run", help="the side-by-side benchmark (make bench)")
    _sized(bench, "system")
    bench.add_argument(
        "--systems",
        type=_systems,
        default=SYSTEMS,
        help=f"comma-separated subset of {','.join(SYSTEMS)}",
    )
    bench.add_argument("--no-latency", action="store_true", help="skip the latency runs")
    bench.add_argument(
        "--latency-seconds", type=float, default=10.0, help="publishing time per latency run"
    )
    bench.add_argument(
        "--latency-rates",
        type=_positive_numbers,
        default=(500.0, 1000.0, 2000.0),
        help="comma-separated publishing rates (msg/s) of the latency table (default "
        "500,1000,2000)",
    )
    bench.add_argument(
        "--latency-warmup",
        type=float,
        default=1.0,
        help="seconds of each latency run left out of the quantiles",
    )
    bench.add_argument("--no-prefetch", action="store_true", help="skip the prefetch table")
    bench.add_argument(
        "--prefetches",
        type=_positive_ints,
        default=(10, 50, 400),
        help="comma-separated prefetches of the prefetch table (default 10,50,400)",
    )
    bench.add_argument(
        "--no-handlers", action="store_true", help="skip the per-event handlers' table"
    )
    bench.add_argument(
        "--handlers",
        type=_handler_modes,
        default=handlers.MODES,
        help=f"comma-separated subset of {','.join(handlers.MODES)} (the per-event handlers' "
        "table)",
    )
    bench.add_argument(
        "--handler-events",
        type=float,
        default=1.0,
        help="scale of the per-event handlers' events per run (default 1: "
        + ", ".join(f"{mode} {count}" for mode, count in handler_rows.DEFAULT_EVENTS.items())
        + ")",
    )
    _common(bench)
    soak_cmd = commands.add_parser("soak", help="a long run watching the service's RSS (make soak)")
    soak_cmd.add_argument(
        "--events",
        type=int,
        default=_env_int("SOAK_EVENTS", 1_000_000),
        help="events in all (env SOAK_EVENTS; default 1000000)",
    )
    soak_cmd.add_argument("--sample-seconds", type=float, default=5.0)
    soak_cmd.add_argument(
        "--warmup-fraction",
        type=float,
        default=0.1,
        help="growth is measured from the first sample after this fraction of the events",
    )
    soak_cmd.add_argument(
        "--backlog", type=int, default=5_000, help="at most about this many messages queued"
    )
    soak_cmd.add_argument("--rss-limit-mb", type=float, default=150.0)
    soak_cmd.add_argument("--growth-limit", type=float, default=0.10)
    _common(soak_cmd)
    receipts_cmd = commands.add_parser(
        "receipts", help="receipts retention: upgrade lock, prune of a day, insert cost"
    )
    receipts_cmd.add_argument(
        "--rows", type=int, default=50_000_000, help="receipts over the week (default 50000000)"
    )
    receipts_cmd.add_argument(
        "--upgrade-rows",
        type=int,
        default=10_000_000,
        help="receipts in the plain table the upgrade migrates (default 10000000)",
    )
    receipts_cmd.add_argument("--batches", type=int, default=2000)
    receipts_cmd.add_argument(
        "--partition",
        type=partition_span,
        default=receipts.DEFAULT_PARTITION,
        help="the span of the receipts' partitions, as CONSUMER_RECEIPT_PARTITION (default 1h)",
    )
    receipts_cmd.add_argument("--batch-size", type=int, default=50)
    receipts_cmd.add_argument(
        "--admin-dsn",
        default=os.environ.get("BENCH_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"),
    )
    receipts_cmd.add_argument("--results-dir", type=Path, default=RESULTS)
    prune_cmd = commands.add_parser(
        "prune-load",
        help="the service's throughput while consumer receipts prune runs, against without",
    )
    _sized(prune_cmd, "mode")
    prune_cmd.add_argument(
        "--days", type=int, default=4, help="old daily partitions, each pruned in turn (default 4)"
    )
    prune_cmd.add_argument(
        "--rows-per-day",
        type=int,
        default=1_000_000,
        help="synthetic receipts in each old partition (default 1000000)",
    )
    prune_cmd.add_argument(
        "--modes",
        type=_modes,
        default=prune_load.MODES,
        help=f"comma-separated subset of {','.join(prune_load.MODES)} (default all)",
    )
    prune_cmd.add_argument(
        "--every",
        type=float,
        default=1.0,
        help="seconds from one prune round's start to the next's, at least (default 1)",
    )
    _common(prune_cmd)
    dlq_cmd = commands.add_parser(
        "dlq", help="dead-letter tools: list and replay of 100,000 letters, time and peak RSS"
    )
    dlq_cmd.add_argument("--letters", type=int, default=100_000, help="default 100000")
    dlq_cmd.add_argument(
        "--payload-bytes",
        type=int,
        default=200,
        help="a producer header of this many bytes in each letter (default 200)",
    )
    dlq_cmd.add_argument(
        "--amqp-url",
        default=os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
    )
    dlq_cmd.add_argument(
        "--memory",
        type=_counts,
        default=None,
        metavar="N,M",
        help="instead of --letters: a run at each count (e.g. 10000,100000), and the replay's "
        "peak RSS at the last against the first (issue 31's goal: at most 1.10)",
    )
    dlq_cmd.add_argument("--results-dir", type=Path, default=RESULTS)
    return root


def _counts(text: str) -> tuple[int, ...]:
    try:
        counts = tuple(int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not comma-separated counts: {text!r}") from None
    if len(counts) < 2 or min(counts) < 1:
        raise argparse.ArgumentTypeError("at least two counts, each at least 1")
    return counts


def _dlq(arguments: argparse.Namespace) -> int:
    if arguments.letters < 1:
        raise SystemExit("--letters must be at least 1")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    options = dlq.DlqOptions(
        letters=arguments.letters,
        payload_bytes=arguments.payload_bytes,
        amqp_url=arguments.amqp_url,
    )
    if arguments.memory is not None:
        memory = asyncio.run(dlq.run_memory(options, arguments.memory))
        return _saved(memory, dlq.memory_table(memory), arguments.results_dir, stamp)
    result = asyncio.run(dlq.run_dlq(options))
    return _saved(result, dlq.table(result), arguments.results_dir, stamp)


def _receipts(arguments: argparse.Namespace) -> int:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    options = receipts.ReceiptsOptions(
        rows=arguments.rows,
        upgrade_rows=arguments.upgrade_rows,
        batches=arguments.batches,
        batch_size=arguments.batch_size,
        admin_dsn=arguments.admin_dsn,
        results_dir=arguments.results_dir,
        partition=arguments.partition,
    )
    result = asyncio.run(receipts.run_receipts(options))
    return _saved(result, receipts.table(result), arguments.results_dir, stamp)


def _saved(result: dict[str, Any], text: str, directory: Path, stamp: str) -> int:
    saved = report.save(result, text, directory, stamp)
    print(text)
    print(f"saved {saved} and {saved.with_suffix('.txt').name}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    arguments = parser().parse_args(argv)
    if arguments.command == "receipts":
        return _receipts(arguments)
    if arguments.command == "dlq":
        return _dlq(arguments)
    service_env = _service_env(arguments.service_env)
    if arguments.events < 1:
        raise SystemExit("--events must be at least 1")
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    try:
        if arguments.command == "prune-load":
            if min(arguments.runs, arguments.days, arguments.rows_per_day) < 1:
                raise SystemExit("--runs, --days and --rows-per-day must be at least 1")
            result = asyncio.run(
                prune_load.run_prune_load(
                    prune_load.PruneLoadOptions(
                        events=arguments.events,
                        runs=arguments.runs,
                        skus=arguments.skus,
                        seed=arguments.seed,
                        days=arguments.days,
                        rows_per_day=arguments.rows_per_day,
                        modes=arguments.modes,
                        every=arguments.every,
                        service_env=service_env,
                        amqp_url=arguments.amqp_url,
                        admin_dsn=arguments.admin_dsn,
                        results_dir=arguments.results_dir,
                        keep_logs=arguments.keep_logs,
                    )
                )
            )
            text = prune_load.table(result)
        elif arguments.command == "run":
            if arguments.runs < 1:
                raise SystemExit("--runs must be at least 1")
            result = asyncio.run(
                run_bench(
                    BenchOptions(
                        events=arguments.events,
                        runs=arguments.runs,
                        skus=arguments.skus,
                        seed=arguments.seed,
                        systems=arguments.systems,
                        service_env=service_env,
                        latency=not arguments.no_latency,
                        latency_seconds=arguments.latency_seconds,
                        latency_warmup=arguments.latency_warmup,
                        latency_rates=arguments.latency_rates,
                        prefetch=not arguments.no_prefetch,
                        prefetches=arguments.prefetches,
                        handlers=not arguments.no_handlers,
                        handler_modes=arguments.handlers,
                        handler_events=_handler_events(arguments.handler_events),
                        amqp_url=arguments.amqp_url,
                        admin_dsn=arguments.admin_dsn,
                        results_dir=arguments.results_dir,
                        keep_logs=arguments.keep_logs,
                    )
                )
            )
            text = report.table(result)
        else:
            result = asyncio.run(
                soak.run_soak(
                    soak.SoakOptions(
                        events=arguments.events,
                        skus=arguments.skus,
                        seed=arguments.seed,
                        service_env=service_env,
                        sample_seconds=arguments.sample_seconds,
                        warmup_fraction=arguments.warmup_fraction,
                        backlog=arguments.backlog,
                        rss_limit_mb=arguments.rss_limit_mb,
                        growth_limit=arguments.growth_limit,
                        amqp_url=arguments.amqp_url,
                        admin_dsn=arguments.admin_dsn,
                        results_dir=arguments.results_dir,
                        keep_logs=arguments.keep_logs,
                    )
                )
            )
            text = soak.table(result)
    except BenchError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    saved = report.save(result, text, arguments.results_dir, stamp)
    print(text)
    print(f"saved {saved} and {saved.with_suffix('.txt').name}")
    print(report.json_line(result))
    return 0
