"""The benchmark's summaries and tables, from made-up measurements (no broker, no database)."""

from __future__ import annotations

import math

from bench.measure import Measurement, quantile
from bench.report import PREFETCH_GOAL, over, prefetch_lines, summarize_prefetch


def _runs(system: str, *rates: float, cpu: float = 50.0) -> list[Measurement]:
    return [
        Measurement(system, run, 1000, rate=rate, cpu={"sut": cpu})
        for run, rate in enumerate(rates, start=1)
    ]


def test_a_ratio_is_missing_when_either_side_is() -> None:
    assert over(850.0, 1000.0) == 0.85
    assert over(None, 1000.0) is None
    assert over(850.0, None) is None
    assert over(850.0, 0.0) is None


def test_a_prefetch_row_compares_the_medians_against_the_goal() -> None:
    row = summarize_prefetch(
        10, 3, _runs("broker", 4000, 4200, 3900), _runs("service", 700, 600, 800)
    )
    assert row["broker"]["rate"]["median"] == 4000
    assert row["service"]["rate"]["median"] == 700
    assert row["service_over_broker"] == 0.175
    assert row["goal_met"] is False

    fast = summarize_prefetch(
        400, 50, _runs("broker", 4000), _runs("service", 4000 * PREFETCH_GOAL)
    )
    assert fast["goal_met"] is True


def test_a_prefetch_row_without_a_service_rate_has_no_verdict() -> None:
    failed = [Measurement("service", 1, 1000, error="the service exited 1\ntraceback")]
    row = summarize_prefetch(50, 13, _runs("broker", 4000), failed)
    assert row["service_over_broker"] is None
    assert row["goal_met"] is None
    lines = prefetch_lines([row], runs=1)
    assert lines[-1] == "    ! service run 1: the service exited 1"
    assert "-" in lines[2].split()


def test_the_prefetch_table_has_one_line_per_prefetch_with_its_figures() -> None:
    rows = [
        summarize_prefetch(p, b, _runs("broker", 4000, cpu=40), _runs("service", r, cpu=80))
        for p, b, r in ((10, 3, 3600), (50, 13, 2000))
    ]
    lines = prefetch_lines(rows, runs=1)
    assert len(lines) == 4
    assert lines[2].split() == [
        *("10", "3", "4,000", "4,000", "-", "4,000"),
        *("3,600", "3,600", "-", "3,600", "0.90", "met", "0.100/0.220"),
    ]
    assert "below goal" in lines[3]


def test_the_nearest_rank_quantile() -> None:
    values = [float(v) for v in range(1, 101)]
    assert quantile(values, 0.5) == 50
    assert quantile(values, 0.99) == 99
    assert quantile(values, 1.0) == 100
    assert quantile([7.0], 0.99) == 7
    assert math.isnan(quantile([], 0.5))
