"""The benchmark's summaries and tables, from made-up measurements (no broker, no database)."""

from __future__ import annotations

import math
import uuid

from bench.measure import Measurement, latency_figures, quantile, start_figures
from bench.report import (
    PREFETCH_GOAL,
    SUSTAIN_BACKLOG_SECONDS,
    latency_lines,
    over,
    prefetch_lines,
    summarize_latency_rate,
    summarize_prefetch,
    sustained,
)


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
        summarize_prefetch(p, b, _runs("broker", 4000, cpu=40), _runs("service", r, cpu=80), 1)
        for p, b, r in ((10, 10, 3600), (50, 50, 2000))
    ]
    lines = prefetch_lines(rows, runs=1)
    assert len(lines) == 4
    assert lines[2].split() == [
        *("10", "1", "10", "4,000", "4,000", "-", "4,000"),
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


def _latency(system: str, p99: float, backlog: int, rate: float = 1000) -> Measurement:
    extra = {
        "p50_ms": p99 / 3,
        "p99_ms": p99,
        "max_ms": p99 * 2,
        "published_rate": rate,
        "backlog_at_end": backlog,
        "samples": 900,
    }
    return Measurement(system, 1, 1000, rate=rate, cpu={"sut": 30, "harness": 20}, extra=extra)


def test_a_rate_is_sustained_while_the_backlog_stays_within_half_a_second_of_publishing() -> None:
    assert sustained(1000, 0) is True
    assert sustained(1000, 1000 * SUSTAIN_BACKLOG_SECONDS) is True
    assert sustained(1000, 1000 * SUSTAIN_BACKLOG_SECONDS + 1) is False
    assert sustained(1000, None) is None


def test_the_service_is_compared_only_with_the_peers_that_sustain_the_rate() -> None:
    row = summarize_latency_rate(
        1000,
        {
            "service": [_latency("service", 12, 5)],
            "celery": [_latency("celery", 30, 10)],
            "dramatiq": [_latency("dramatiq", 8, 5000)],  # queueing: not counted
        },
    )
    assert row["systems"]["dramatiq"]["sustained"] is False
    assert row["service_p99_below_sustaining_peers"] is True
    assert row["service_p99_under_goal"] is True

    slower = summarize_latency_rate(
        1000, {"service": [_latency("service", 25, 5)], "celery": [_latency("celery", 20, 5)]}
    )
    assert slower["service_p99_below_sustaining_peers"] is False
    assert slower["service_p99_under_goal"] is False


def test_no_verdict_without_a_sustaining_peer_and_the_20_ms_goal_only_at_1000() -> None:
    row = summarize_latency_rate(
        2000,
        {"service": [_latency("service", 40, 5, 2000)], "celery": [_latency("celery", 9, 9999)]},
    )
    assert row["service_p99_below_sustaining_peers"] is None
    assert row["service_p99_under_goal"] is None


def test_a_service_that_does_not_sustain_the_rate_meets_no_goal() -> None:
    row = summarize_latency_rate(
        1000, {"service": [_latency("service", 5, 9999)], "celery": [_latency("celery", 30, 5)]}
    )
    assert row["service_p99_below_sustaining_peers"] is False
    assert row["service_p99_under_goal"] is False


def test_the_latency_table_has_a_line_per_system_and_the_goals_per_rate() -> None:
    failed = Measurement("dramatiq", 1, 0, error="dramatiq exited 1\nTraceback")
    rows = [
        summarize_latency_rate(
            rate,
            {
                "service": [_latency("service", 12, 5, rate)],
                "celery": [_latency("celery", 30, 10, rate)],
                "dramatiq": [failed],
            },
        )
        for rate in (500, 1000)
    ]
    lines = latency_lines(rows, runs=1)[1:]  # the line explaining the start column left out
    assert lines[2].split()[:9] == [
        "500", "service", "-/-", "4.00", "12.00", "24.0", "500", "5", "yes"
    ]  # fmt: skip
    assert lines[2].split()[9:] == ["30/20/-/-,", "-"]
    assert lines[4].split()[:3] == ["500", "dramatiq", "-/-"]
    assert lines[5] == "    ! dramatiq run 1: dramatiq exited 1"
    assert lines[6].strip() == "service p99 below the sustaining peers': yes"
    assert lines[-1].strip() == ("service p99 below the sustaining peers': yes; under 20 ms: yes")


def test_latency_counts_the_events_published_after_the_warm_up_that_committed() -> None:
    ids = [uuid.UUID(int=n) for n in range(5)]
    published = {ids[n]: 100.0 + n * 0.5 for n in range(5)}  # 100.0 ... 102.0
    committed = {ids[n]: published[ids[n]] + (n + 1) / 1000 for n in range(4)}  # the last: not
    figures = latency_figures(published, committed, warmup=1.0)
    assert figures["samples"] == 2  # published at 101.0 and 101.5; 102.0 never committed
    assert figures["p50_ms"] == 3.0
    assert figures["p99_ms"] == figures["max_ms"] == 4.0
    assert figures["published_rate"] == 2.0
    assert figures["backlog_at_end"] == 1  # the last, never committed


def test_the_start_latency_is_publish_to_the_applying_transactions_start() -> None:
    ids = [uuid.UUID(int=n) for n in range(3)]
    published = {ids[n]: 10.0 + n for n in range(3)}
    started = {ids[0]: 10.001, ids[1]: 11.002, ids[2]: 12.010}
    figures = start_figures(published, started, warmup=0)
    assert figures == {"start_p50_ms": 2.0, "start_p99_ms": 10.0}


def test_the_backlog_is_what_had_not_committed_when_the_last_event_was_published() -> None:
    ids = [uuid.UUID(int=n) for n in range(4)]
    published = {ids[n]: 10.0 + n for n in range(4)}  # the last at 13.0
    committed = {ids[0]: 10.5, ids[1]: 12.9, ids[2]: 13.5, ids[3]: 14.0}
    assert latency_figures(published, committed, warmup=0)["backlog_at_end"] == 2
