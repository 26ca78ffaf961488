"""The per-event handlers' table of ``make bench``: each handler of :mod:`bench.handlers` at the
service's defaults against a sweep of hand-tuned ``CONSUMER_WORKERS`` / ``CONSUMER_BATCH_SIZE``,
interleaved run by run (run 1 of every handler and setting, then run 2...), in the same invocation
as the rest of the tables.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from typing import Any

from bench import measure, report
from bench.events import Workload
from bench.handlers import MODES
from bench.infra import Infra
from bench.measure import Measurement

__all__ = ["DEFAULT_EVENTS", "SWEEP", "handler_lines", "handler_rows"]

SWEEP: tuple[tuple[int, int], ...] = ((1, 50), (1, 5), (2, 50), (2, 5), (4, 50), (4, 5), (4, 1))
"""(CONSUMER_WORKERS, CONSUMER_BATCH_SIZE) pairs tried by hand; the best of them is the goal's
yardstick (defaults at least 0.9 of it)."""

DEFAULT_EVENTS = {"db": 4000, "io5": 1500, "io50": 300, "cpu2": 1500}
"""Events per run: a slow handler gets fewer, so that its slowest setting ends in seconds."""

GOAL = 0.9

Guarded = Callable[[str, int, int, Callable[[], Awaitable[Measurement]]], Awaitable[Measurement]]


def _label(setting: tuple[int, int] | None) -> str:
    return "defaults" if setting is None else f"w{setting[0]} b{setting[1]}"


async def handler_rows(
    infra: Infra,
    workload: Workload,
    *,
    runs: int,
    modes: Sequence[str],
    events: Mapping[str, int],
    service_env: Mapping[str, str],
    guarded: Guarded,
) -> list[dict[str, Any]]:
    settings: list[tuple[int, int] | None] = [None, *SWEEP]
    measured: dict[str, dict[str, list[Measurement]]] = {
        mode: {_label(setting): [] for setting in settings} for mode in modes
    }
    for run in range(1, runs + 1):
        for mode in modes:
            sized = Workload(events.get(mode, DEFAULT_EVENTS[mode]), workload.skus, workload.seed)
            for setting in settings:
                env = {
                    **service_env,
                    "CONSUMER_HANDLERS": "bench.handlers",
                    "BENCH_HANDLER": mode,
                }
                if setting is not None:
                    env["CONSUMER_WORKERS"] = str(setting[0])
                    env["CONSUMER_BATCH_SIZE"] = str(setting[1])
                setting_label = _label(setting)

                async def action(
                    run: int = run,
                    env: dict[str, str] = env,
                    sized: Workload = sized,
                    label: str = f"h{mode}",
                ) -> Measurement:
                    return await measure.service_throughput(
                        infra, sized, run, service_env=env, label=label
                    )

                measured[mode][setting_label].append(
                    await guarded(f"{mode} {setting_label}", run, sized.events, action)
                )
    return [_summary(mode, measured[mode]) for mode in modes]


def _summary(mode: str, by_setting: Mapping[str, Sequence[Measurement]]) -> dict[str, Any]:
    rates = {label: report.spread(run.rate for run in runs) for label, runs in by_setting.items()}
    tuned = {label: stats for label, stats in rates.items() if label != "defaults" and stats}
    best = max(tuned, key=lambda label: tuned[label]["median"]) if tuned else None
    defaults = rates.get("defaults")
    ratio = (
        round(defaults["median"] / tuned[best]["median"], 3)
        if defaults and best and tuned[best]["median"]
        else None
    )
    chosen = [
        {"workers": run.extra.get("workers"), "batch_size": run.extra.get("batch_size")}
        for run in by_setting.get("defaults", ())
    ]
    return {
        "handler": mode,
        "events": next((run.events for runs in by_setting.values() for run in runs), 0),
        "rates": rates,
        "best": best,
        "defaults_over_best": ratio,
        "goal": GOAL,
        "met": ratio is not None and ratio >= GOAL,
        "defaults_chose": chosen,
        "errors": [
            f"{label} run {run.run}: {run.error}"
            for label, runs in by_setting.items()
            for run in runs
            if run.error
        ],
    }


_NAMES = {
    "db": "database only",
    "io5": "awaits 5 ms",
    "io50": "awaits 50 ms",
    "cpu2": "2 ms pure Python",
}


def handler_lines(rows: Sequence[dict[str, Any]], runs: int) -> list[str]:
    """Per handler: msg/s at the defaults (and the workers / batch size they ended with), at each
    hand-tuned setting, the best, and defaults / best against the goal."""
    labels = ["defaults", *(_label(setting) for setting in SWEEP)]
    lines = [
        f"per-event handlers (inventory.reserve, one statement each; msg/s, medians of {runs}; "
        f"goal: defaults >= {GOAL:g} of the best hand-tuned CONSUMER_WORKERS (w) / "
        "CONSUMER_BATCH_SIZE (b)):",
        f"{'handler':<18}{'events':>7}"
        + "".join(f"{label:>10}" for label in labels)
        + "  best      defaults/best  defaults ended at",
    ]
    for row in rows:
        rates = row["rates"]
        cells = "".join(
            f"{report._num((rates.get(label) or {}).get('median')):>10}" for label in labels
        )
        chose = ", ".join(
            f"w{_int(c['workers'])} b{_int(c['batch_size'])}" for c in row["defaults_chose"]
        )
        verdict = "met" if row["met"] else "NOT met"
        lines.append(
            f"{_NAMES.get(row['handler'], row['handler']):<18}{row['events']:>7}{cells}  "
            f"{row['best'] or '-':<10}{report._num(row['defaults_over_best'], 2):>6} {verdict:<8}"
            f"{chose}"
        )
        for error in row["errors"]:
            lines.append(f"    ! {error.splitlines()[0][:200]}")
    return lines


def _int(value: Any) -> str:
    return "-" if value is None else str(int(value))


assert set(DEFAULT_EVENTS) == set(MODES)
