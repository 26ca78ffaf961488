"""The outbox benchmark's pure parts: latencies from two clocks' maps, their quantiles, the table
and the goal's verdict, from made-up figures (no broker, no database)."""

from __future__ import annotations

import uuid

import pytest

from bench.outbox import (
    GOAL_MS,
    GOAL_RATE,
    RATES,
    latencies_ms,
    main,
    outbox_lines,
    summarize_latency,
)


def test_latencies_leave_out_the_warmup_and_rows_that_never_arrived() -> None:
    early, late, lost, slow = (uuid.uuid4() for _ in range(4))
    starts = {early: 10.0, late: 11.5, lost: 11.6, slow: 12.0}
    ends = {early: 10.001, late: 11.502, slow: 12.0305}
    assert latencies_ms(starts, ends, warmup_until=11.0) == pytest.approx([2.0, 30.5])


def test_the_summary_is_nearest_rank_over_sorted_milliseconds() -> None:
    values = [float(n) for n in range(1, 201)]
    assert summarize_latency(values) == {
        "count": 200,
        "p50_ms": 100.0,
        "p99_ms": 198.0,
        "max_ms": 200.0,
    }
    assert summarize_latency([]) == {"count": 0, "p50_ms": None, "p99_ms": None, "max_ms": None}


def _row(rate: float, p99: float | None) -> dict[str, object]:
    figures = {"count": 900, "p50_ms": 5.0, "p99_ms": p99, "max_ms": None if p99 is None else 40.0}
    return {"rate": rate, "produced_rate": rate - 1, "arrival": figures, "confirmed": figures}


def test_the_table_has_a_line_per_rate_the_throughput_and_the_goal() -> None:
    result = {
        "machine": "2 cores, load average 1.00 1.00 1.00 at start",
        "rates": [_row(GOAL_RATE, GOAL_MS - 1), _row(1000.0, 35.0)],
        "throughput": {"rows": 20_000, "rate": 1800.0, "table_rate": 1900.0},
    }
    text = "\n".join(outbox_lines(result))
    assert "| 500 | 499 | 900 | 5.0 | 19.0 | 5.0 | 19.0 | 40.0 |" in text
    assert "| 1,000 | 999 | 900 | 5.0 | 35.0 | 5.0 | 35.0 | 40.0 |" in text
    assert "top throughput: 1,800 rows/s (20,000 rows" in text
    assert text.endswith(f"under {GOAL_MS:.0f} ms at {GOAL_RATE:.0f}/s: yes")


def test_the_goal_fails_at_or_over_the_limit_and_is_left_out_without_its_rate() -> None:
    over = {"machine": "m", "rates": [_row(GOAL_RATE, GOAL_MS)], "throughput": None}
    assert outbox_lines(over)[-1].endswith(": NO")
    other = {"machine": "m", "rates": [_row(1000.0, 5.0), _row(GOAL_RATE, None)]}
    assert not any("under" in line for line in outbox_lines(other))


def test_the_default_rates_are_the_issues() -> None:
    assert RATES == (500.0, 1000.0)


@pytest.mark.parametrize(
    "argv", [["--seconds", "1"], ["--backlog", "0"], ["--rates", "0"], ["--connections", "0"]]
)
def test_arguments_that_measure_nothing_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        main(argv)
