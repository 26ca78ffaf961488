"""Medians, spreads, ratios, the table, the JSON line, and the files under ``bench/results/``."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from bench.measure import Measurement

LABELS = {
    "broker": "broker limit: aio-pika ack-only",
    "database": "database limit: pgbench, batched",
    "service": "service: python -m consumer run",
    "celery": "celery: prefork x2, acks_late",
    "dramatiq": "dramatiq: 2 processes x 4 threads",
}


def spread(values: Iterable[float | None]) -> dict[str, float] | None:
    """Median, min and max of the values that exist; None if none do."""
    present = [value for value in values if value is not None and not math.isnan(value)]
    if not present:
        return None
    return {
        "median": round(statistics.median(present), 2),
        "min": round(min(present), 2),
        "max": round(max(present), 2),
        "n": len(present),
    }


def summarize_system(runs: Sequence[Measurement]) -> dict[str, Any]:
    groups = sorted({group for run in runs for group in run.cpu})
    return {
        "rate": spread(run.rate for run in runs),
        "wall_s": spread(run.wall_s for run in runs),
        "peak_rss_mb": spread(run.peak_rss_mb for run in runs),
        "cpu_pct": {
            group: (spread(run.cpu.get(group) for run in runs) or {}).get("median")
            for group in groups
        },
        # CPU time per message of each group (machine excepted): steadier than the rate on a
        # shared machine, since waiting for a busy core costs no CPU time.
        "cpu_ms_per_msg": {
            group: (spread(_per_message(run, group) for run in runs) or {}).get("median")
            for group in groups
            if group != "machine"
        },
        "errors": [f"run {run.run}: {run.error}" for run in runs if run.error],
        "runs": [asdict(run) for run in runs],
    }


def _per_message(run: Measurement, group: str) -> float | None:
    percent = run.cpu.get(group)
    if percent is None or not run.rate:
        return None
    return percent / 100 / run.rate * 1000


def summarize_latency(runs: Sequence[Measurement]) -> dict[str, Any]:
    def pick(key: str) -> dict[str, float] | None:
        values = [run.extra.get(key) for run in runs if run.error is None]
        return spread(float(value) for value in values if isinstance(value, int | float))

    return {
        "rate": spread(run.rate for run in runs if run.error is None),
        "p50_ms": pick("p50_ms"),
        "p99_ms": pick("p99_ms"),
        "max_ms": pick("max_ms"),
        "histogram_p50_ms": pick("histogram_p50_ms"),
        "histogram_p99_ms": pick("histogram_p99_ms"),
        "published_rate": pick("published_rate"),
        "backlog_at_end": pick("backlog_at_end"),
        "cpu_pct": {
            group: (spread(run.cpu.get(group) for run in runs if run.error is None) or {}).get(
                "median"
            )
            for group in sorted({group for run in runs for group in run.cpu})
        },
        "samples": sum(int(run.extra.get("samples", 0)) for run in runs),
        "errors": [f"run {run.run}: {run.error}" for run in runs if run.error],
        "runs": [asdict(run) for run in runs],
    }


def _median(summary: dict[str, Any], system: str) -> float | None:
    rate = summary.get(system, {}).get("rate")
    return None if rate is None else float(rate["median"])


def over(value: float | None, other: float | None) -> float | None:
    """``value / other`` to 3 places, or None when either is missing (or ``other`` is not > 0)."""
    if value is None or other is None or other <= 0:
        return None
    return round(value / other, 3)


def ratios(systems: dict[str, Any]) -> dict[str, float | None]:
    service = _median(systems, "service")
    limits = [x for x in (_median(systems, "broker"), _median(systems, "database")) if x]
    return {
        "service_over_celery": over(service, _median(systems, "celery")),
        "service_over_dramatiq": over(service, _median(systems, "dramatiq")),
        "service_over_limit": over(service, min(limits) if limits else None),
    }


# The goal: at every prefetch the service drains at least this share of the ack-only rate.
PREFETCH_GOAL = 0.85


def summarize_prefetch(
    prefetch: int, batch_size: int, broker: Sequence[Measurement], service: Sequence[Measurement]
) -> dict[str, Any]:
    """One row of the prefetch table: both systems' runs at one prefetch, and the ratio of the
    medians."""
    summaries = {"broker": summarize_system(broker), "service": summarize_system(service)}
    ratio = over(_median(summaries, "service"), _median(summaries, "broker"))
    return {
        "prefetch": prefetch,
        "batch_size": batch_size,
        **summaries,
        "service_over_broker": ratio,
        "goal_met": None if ratio is None else ratio >= PREFETCH_GOAL,
    }


def _num(value: float | None, digits: int = 0) -> str:
    if value is None or math.isnan(value):
        return "-"
    return f"{value:,.{digits}f}"


def _range(stats: dict[str, float] | None, digits: int = 0) -> str:
    if stats is None:
        return "-"
    return f"{_num(stats['min'], digits)} - {_num(stats['max'], digits)}"


def table(result: dict[str, Any]) -> str:
    settings = result["settings"]
    lines = [
        f"rabbit-pg-consumer benchmark {result['started']}: {result['events']:,} events x "
        f"{result['runs']} runs, {result['skus']} SKUs, qty 1, persistent, quorum work queues",
        "service settings: "
        + ", ".join(f"{key}={value}" for key, value in settings["service"].items()),
        f"versions: {', '.join(f'{k} {v}' for k, v in result['versions'].items())}",
        f"machine: {result['machine']}",
        "",
        f"{'system':<36}{'msg/s median':>13}{'min - max':>20}{'wall s':>8}"
        f"{'peak RSS MB':>13}{'sut CPU ms/msg':>16}   CPU % of a core: sut/pg/rabbit, machine %",
    ]
    systems = result["systems"]
    for key, label in LABELS.items():
        summary = systems.get(key)
        if summary is None:
            continue
        rate = summary["rate"]
        cpu = summary["cpu_pct"]
        cpu_text = "/".join(_num(cpu.get(group)) for group in ("sut", "postgres", "rabbitmq"))
        lines.append(
            f"{label:<36}{_num(rate and rate['median']):>13}{_range(rate):>20}"
            f"{_num(summary['wall_s'] and summary['wall_s']['median'], 1):>8}"
            f"{_num(summary['peak_rss_mb'] and summary['peak_rss_mb']['median'], 1):>13}"
            f"{_num(summary['cpu_ms_per_msg'].get('sut'), 3):>16}"
            f"   {cpu_text}, {_num(cpu.get('machine'))}"
        )
        for error in summary["errors"]:
            lines.append(f"    ! {error.splitlines()[0][:200]}")
    latency = result.get("latency")
    if latency:
        lines.append("")
        p50, p99 = latency["p50_ms"], latency["p99_ms"]
        h50, h99 = latency["histogram_p50_ms"], latency["histogram_p99_ms"]
        rate = latency["rate"]
        achieved, backlog = latency["published_rate"], latency["backlog_at_end"]
        cpu = latency["cpu_pct"]
        lines.append(
            f"service publish->commit latency, paced at {_num(rate and rate['median'])} msg/s "
            f"(achieved {_num(achieved and achieved['median'])}), "
            f"{latency['samples']:,} events after warm-up:"
        )
        lines.append(
            f"  commit clock: p50 {_num(p50 and p50['median'], 2)} ms ({_range(p50, 2)}), "
            f"p99 {_num(p99 and p99['median'], 2)} ms ({_range(p99, 2)})"
        )
        lines.append(
            f"  service's consumer_event_lag_seconds (bucket-interpolated): "
            f"p50 {_num(h50 and h50['median'], 2)} ms, p99 {_num(h99 and h99['median'], 2)} ms"
        )
        lines.append(
            f"  not yet committed when publishing stopped: {_num(backlog and backlog['median'])}; "
            "CPU % while publishing: "
            + ", ".join(f"{group} {_num(value)}" for group, value in cpu.items())
        )
        for error in latency["errors"]:
            lines.append(f"    ! {error.splitlines()[0][:200]}")
    if result.get("prefetch"):
        lines.append("")
        lines.extend(prefetch_lines(result["prefetch"], result["runs"]))
    ratio = result["ratios"]
    lines.append("")
    lines.append(
        "ratios (medians): "
        f"service/celery {_num(ratio['service_over_celery'], 2)}, "
        f"service/dramatiq {_num(ratio['service_over_dramatiq'], 2)}, "
        f"service/min(broker, database) {_num(ratio['service_over_limit'], 2)}"
    )
    return "\n".join(lines)


def prefetch_lines(rows: Sequence[dict[str, Any]], runs: int) -> list[str]:
    """The prefetch table: per prefetch, the ack-only consumer's and the service's drain rates
    (medians, min - max), their ratio against the goal, and each one's CPU time per message."""
    lines = [
        f"service against the ack-only consumer at the same prefetch (same quorum queue, "
        f"interleaved, medians of {runs}; goal service/ack-only >= {PREFETCH_GOAL}):",
        f"{'prefetch':>8}{'batch':>7}{'ack-only msg/s':>16}{'min - max':>18}"
        f"{'service msg/s':>15}{'min - max':>18}{'service/ack-only':>18}"
        f"   sut CPU ms/msg ack-only/service",
    ]
    for row in rows:
        broker, service = row["broker"], row["service"]
        verdict = {True: "met", False: "below goal", None: "-"}[row["goal_met"]]
        lines.append(
            f"{row['prefetch']:>8}{row['batch_size']:>7}"
            f"{_num(broker['rate'] and broker['rate']['median']):>16}{_range(broker['rate']):>18}"
            f"{_num(service['rate'] and service['rate']['median']):>15}"
            f"{_range(service['rate']):>18}"
            f"{_num(row['service_over_broker'], 2):>9} {verdict:<11}"
            f"   {_num(broker['cpu_ms_per_msg'].get('sut'), 3)}"
            f"/{_num(service['cpu_ms_per_msg'].get('sut'), 3)}"
        )
        for side in ("broker", "service"):
            for error in row[side]["errors"]:
                lines.append(f"    ! {side} {error.splitlines()[0][:200]}")
    return lines


def save(result: dict[str, Any], text: str, directory: Path, stamp: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result['kind']}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    path.with_suffix(".txt").write_text(text + "\n")
    return path


def json_line(result: dict[str, Any]) -> str:
    """The last line of stdout: the summary without the per-run details."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "runs"}
        return value

    return json.dumps(strip(result), separators=(",", ":"), default=str)
