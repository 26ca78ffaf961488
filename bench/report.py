"""Medians, spreads, ratios, the table, the JSON line, and the files under ``bench/results/``."""

from __future__ import annotations

import json
import math
import statistics
from collections.abc import Iterable, Mapping, Sequence
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


# A system sustains a rate if, when publishing stops, no more than this many seconds' worth of
# events are still uncommitted; beyond that its p99 is queueing, not latency.
SUSTAIN_BACKLOG_SECONDS = 0.5
# The goal at 1,000 msg/s.
LATENCY_GOAL_MS = 20.0
LATENCY_GOAL_RATE = 1000.0


def sustained(rate: float, backlog: float | None) -> bool | None:
    """Whether a run kept up with ``rate``: its backlog at the end is at most
    :data:`SUSTAIN_BACKLOG_SECONDS` of publishing."""
    if backlog is None:
        return None
    return backlog <= rate * SUSTAIN_BACKLOG_SECONDS


def summarize_latency(rate: float, runs: Sequence[Measurement]) -> dict[str, Any]:
    """One system's latency runs at one rate: medians (and spreads) of each figure."""
    ok = [run for run in runs if run.error is None]

    def pick(key: str) -> dict[str, float] | None:
        values = [run.extra.get(key) for run in ok]
        return spread(float(value) for value in values if isinstance(value, int | float))

    backlog = pick("backlog_at_end")
    return {
        **{
            key: pick(key)
            for key in (
                "p50_ms",
                "p99_ms",
                "start_p50_ms",
                "start_p99_ms",
                "max_ms",
                "histogram_p50_ms",
                "histogram_p99_ms",
                "published_rate",
                "backlog_at_end",
            )
        },
        "sustained": sustained(rate, _med(backlog)),
        "cpu_pct": {
            group: (spread(run.cpu.get(group) for run in ok) or {}).get("median")
            for group in sorted({group for run in ok for group in run.cpu})
        },
        "samples": sum(int(run.extra.get("samples", 0)) for run in ok),
        "errors": [f"run {run.run}: {run.error}" for run in runs if run.error],
        "runs": [asdict(run) for run in runs],
    }


def _p99(summary: dict[str, Any] | None) -> float | None:
    if summary is None or summary["p99_ms"] is None:
        return None
    return float(summary["p99_ms"]["median"])


def summarize_latency_rate(
    rate: float, runs: Mapping[str, Sequence[Measurement]]
) -> dict[str, Any]:
    """Every system at one rate, and the issue's goals: the service's p99 below that of each
    peer that sustains the rate, and under :data:`LATENCY_GOAL_MS` at :data:`LATENCY_GOAL_RATE`."""
    systems = {system: summarize_latency(rate, system_runs) for system, system_runs in runs.items()}
    service = systems.get("service")
    mine = _p99(service) if service and service["sustained"] else None
    rivals = [
        _p99(summary)
        for system, summary in systems.items()
        if system != "service" and summary["sustained"]
    ]
    below: bool | None = None
    if service is not None and rivals:
        below = mine is not None and all(other is not None and mine < other for other in rivals)
    under: bool | None = None
    if service is not None and rate == LATENCY_GOAL_RATE:
        under = mine is not None and mine < LATENCY_GOAL_MS
    return {
        "rate": rate,
        "systems": systems,
        "service_p99_below_sustaining_peers": below,
        "service_p99_under_goal": under,
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


SAMEJOB_GOAL = 0.95
"""Issue 31: the service at its defaults drains at least this share of the minimal consumer
that does the same job (:mod:`bench.samejob`)."""


def summarize_prefetch(
    prefetch: int,
    batch_size: int,
    broker: Sequence[Measurement],
    service: Sequence[Measurement],
    workers: int = 0,
    *,
    samejob: Sequence[Measurement] = (),
) -> dict[str, Any]:
    """One row of the prefetch table: the systems' runs at one prefetch, and the ratios of the
    medians (the goal: the service against the minimal same-job consumer when it ran, else
    against the ack-only one)."""
    summaries = {"broker": summarize_system(broker), "service": summarize_system(service)}
    ratio = over(_median(summaries, "service"), _median(summaries, "broker"))
    row: dict[str, Any] = {
        "prefetch": prefetch,
        "workers": workers,
        "batch_size": batch_size,
        **summaries,
        "service_over_broker": ratio,
        "goal_met": None if ratio is None else ratio >= PREFETCH_GOAL,
    }
    if samejob:
        row["samejob"] = summarize_system(samejob)
        job_ratio = over(_median(row, "service"), _median(row, "samejob"))
        row["service_over_samejob"] = job_ratio
        row["samejob_goal_met"] = None if job_ratio is None else job_ratio >= SAMEJOB_GOAL
    return row


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
    if result.get("latency"):
        lines.append("")
        seconds = result["settings"].get("latency", {}).get("seconds")
        lines.extend(latency_lines(result["latency"], result["runs"], seconds))
    if result.get("prefetch"):
        lines.append("")
        lines.extend(prefetch_lines(result["prefetch"], result["runs"]))
    if result.get("handlers"):
        # Here, not at the top: bench.handler_rows imports this module.
        from bench.handler_rows import handler_lines

        lines.append("")
        lines.extend(handler_lines(result["handlers"], result["runs"]))
    ratio = result["ratios"]
    lines.append("")
    lines.append(
        "ratios (medians): "
        f"service/celery {_num(ratio['service_over_celery'], 2)}, "
        f"service/dramatiq {_num(ratio['service_over_dramatiq'], 2)}, "
        f"service/min(broker, database) {_num(ratio['service_over_limit'], 2)}"
    )
    return "\n".join(lines)


LATENCY_LABELS = {"service": "service", "celery": "celery", "dramatiq": "dramatiq"}
_VERDICT = {True: "yes", False: "NO", None: "-"}


def latency_lines(
    rows: Sequence[dict[str, Any]], runs: int, seconds: float | None = None
) -> list[str]:
    """The latency table: per rate and system, publish -> commit p50, p99 and max (medians of
    the runs), whether it sustained the rate, and the CPU of each process while publishing."""
    lines = [
        "publish -> commit latency at paced rates (confirmed publishing, one publisher for all"
        + (f", {seconds:g} s each" if seconds else "")
        + f"; ms, medians of {runs}; goal: service p99 below every peer that sustains the rate, "
        f"< {LATENCY_GOAL_MS:g} ms at {LATENCY_GOAL_RATE:,.0f}/s):",
        "(start: publish -> the start of the applying transaction, p50/p99)",
        f"{'rate/s':>7}  {'system':<10}{'start':>13}{'p50':>10}{'p99':>11}{'max':>10}"
        f"{'published/s':>13}"
        f"{'backlog':>9}  {'sustained':<11}CPU % of a core: sut/harness/rabbit/pg, machine %",
    ]
    for row in rows:
        for system, summary in row["systems"].items():
            cpu = summary["cpu_pct"]
            cpu_text = "/".join(
                _num(cpu.get(group)) for group in ("sut", "harness", "rabbitmq", "postgres")
            )
            verdict = {True: "yes", False: "did not", None: "-"}[summary["sustained"]]
            lines.append(
                f"{row['rate']:>7,.0f}  {LATENCY_LABELS.get(system, system):<10}"
                f"{_start(summary):>13}"
                f"{_num(_med(summary['p50_ms']), 2):>10}{_num(_med(summary['p99_ms']), 2):>11}"
                f"{_num(_med(summary['max_ms']), 1):>10}"
                f"{_num(_med(summary['published_rate'])):>13}"
                f"{_num(_med(summary['backlog_at_end'])):>9}  {verdict:<11}"
                f"{cpu_text}, {_num(cpu.get('machine'))}"
            )
            for error in summary["errors"]:
                lines.append(f"    ! {system} {error.splitlines()[0][:200]}")
        service = row["systems"].get("service")
        if service is None:
            continue
        notes = [
            "service p99 below the sustaining peers': "
            + _VERDICT[row["service_p99_below_sustaining_peers"]]
        ]
        if row["service_p99_under_goal"] is not None:
            notes.append(f"under {LATENCY_GOAL_MS:g} ms: {_VERDICT[row['service_p99_under_goal']]}")
        if service["histogram_p99_ms"] is not None:
            notes.append(
                "its consumer_event_lag_seconds p50/p99 (bucket-interpolated) "
                f"{_num(_med(service['histogram_p50_ms']), 1)}"
                f"/{_num(_med(service['histogram_p99_ms']), 1)} ms"
            )
        lines.append(f"{'':>9}" + "; ".join(notes))
    return lines


def _start(summary: dict[str, Any]) -> str:
    return (
        f"{_num(_med(summary.get('start_p50_ms')), 1)}/{_num(_med(summary.get('start_p99_ms')), 1)}"
    )


def _med(stats: dict[str, float] | None) -> float | None:
    return None if stats is None else stats["median"]


def prefetch_lines(rows: Sequence[dict[str, Any]], runs: int) -> list[str]:
    """The prefetch table: per prefetch, the ack-only consumer's and the service's drain rates
    (medians, min - max), their ratio against the goal, and each one's CPU time per message."""
    lines = [
        f"service against the ack-only consumer at the same prefetch (same quorum queue, "
        f"interleaved, medians of {runs}; goal service/ack-only >= {PREFETCH_GOAL}):",
        f"{'prefetch':>8}{'workers':>8}{'batch':>7}{'ack-only msg/s':>16}{'min - max':>18}"
        f"{'service msg/s':>15}{'min - max':>18}{'service/ack-only':>18}"
        f"   sut CPU ms/msg ack-only/service",
    ]
    for row in rows:
        broker, service = row["broker"], row["service"]
        verdict = {True: "met", False: "below goal", None: "-"}[row["goal_met"]]
        lines.append(
            f"{row['prefetch']:>8}{row.get('workers') or '-':>8}{row['batch_size']:>7}"
            f"{_num(broker['rate'] and broker['rate']['median']):>16}{_range(broker['rate']):>18}"
            f"{_num(service['rate'] and service['rate']['median']):>15}"
            f"{_range(service['rate']):>18}"
            f"{_num(row['service_over_broker'], 2):>9} {verdict:<11}"
            f"   {_num(broker['cpu_ms_per_msg'].get('sut'), 3)}"
            f"/{_num(service['cpu_ms_per_msg'].get('sut'), 3)}"
        )
        if "samejob" in row:
            job = row["samejob"]
            verdict = {True: "met", False: "below goal", None: "-"}[row["samejob_goal_met"]]
            lines.append(
                f"{'':>8}{'':>8}{'':>7}{'same-job msg/s':>16}{_range(job['rate']):>18}"
                f"{_num(job['rate'] and job['rate']['median']):>15}{'':>18}"
                f"{_num(row['service_over_samejob'], 2):>9} {verdict:<11}"
                f"   service / minimal same-job consumer (goal >= {SAMEJOB_GOAL}); its CPU "
                f"{_num(job['cpu_ms_per_msg'].get('sut'), 3)} ms/msg"
            )
        for side in ("broker", "samejob", "service"):
            if side not in row:
                continue
            for error in row[side]["errors"]:
                lines.append(f"    ! {side} {error.splitlines()[0][:200]}")
    return lines


def save(result: dict[str, Any], text: str, directory: Path, stamp: str) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{result['kind']}-{stamp}.json"
    path.write_text(json.dumps(result, indent=2, default=str) + "\n")
    path.with_suffix(".txt").write_text(text + "\n")
    return path


def publish(
    result: dict[str, Any], text: str, directory: Path, summary: dict[str, Any] | None = None
) -> None:
    """A harness's ending: ``result`` and its printed ``text`` saved (:func:`save`, stamped with
    ``result["started"]``), the text printed, where they went, and the summary line last (of
    ``summary``, when the harness leaves bulky parts of ``result`` out of it)."""
    saved = save(result, text, directory, result["started"])
    print(text)
    print(f"saved {saved} and {saved.with_suffix('.txt').name}")
    print(json_line(result if summary is None else summary))


def json_line(result: dict[str, Any]) -> str:
    """The last line of stdout: the summary without the per-run details."""

    def strip(value: Any) -> Any:
        if isinstance(value, dict):
            return {k: strip(v) for k, v in value.items() if k != "runs"}
        return value

    return json.dumps(strip(result), separators=(",", ":"), default=str)
