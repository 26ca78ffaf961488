"""The queue rows' sizing, settings and table, from made-up measurements (no broker, no
database)."""

from __future__ import annotations

from bench.measure import Measurement
from bench.queue_rows import (
    EVENTS,
    LATENCY_CAP,
    LATENCY_SHARE,
    LONG_LIMITS,
    cell_env,
    cell_events,
    kept_up,
    paced_rate,
    queue_row_lines,
    summarize_cell,
)


def test_a_cell_gets_its_events_scaled_and_never_fewer_than_two() -> None:
    assert cell_events("0", 400, 1.0) == EVENTS["0"][400]
    assert cell_events("5ms", 1, 0.5) == round(EVENTS["5ms"][1] / 2)
    assert cell_events("2s", 1, 0.01) == 2
    # A prefetch without its own size takes the biggest prefetch's.
    assert cell_events("0", 50, 1.0) == EVENTS["0"][400]


def test_the_latency_run_is_paced_at_a_share_of_the_throughput_under_the_cap() -> None:
    assert paced_rate(100.0) == 100.0 * LATENCY_SHARE
    assert paced_rate(1_000_000.0) == LATENCY_CAP
    assert paced_rate(None) is None
    assert paced_rate(0.0) is None


def test_only_the_long_handler_gets_the_long_time_limit_and_the_bench_env_wins() -> None:
    fast = cell_env({"CONSUMER_LOG_LEVEL": "WARNING"}, "5ms", 10)
    assert fast == {
        "CONSUMER_LOG_LEVEL": "WARNING",
        "CONSUMER_HANDLERS": "bench.handlers",
        "BENCH_HANDLER": "io5",
        "CONSUMER_PREFETCH": "10",
    }
    slow = cell_env({"CONSUMER_HANDLER_TIMEOUT": "5m"}, "2s", 1)
    assert slow["BENCH_HANDLER"] == "io2s"
    assert slow["CONSUMER_HARD_TIMEOUT"] == LONG_LIMITS["CONSUMER_HARD_TIMEOUT"]
    assert slow["CONSUMER_HANDLER_TIMEOUT"] == "5m"


def test_a_slow_handler_keeps_up_with_its_last_event_still_in_hand() -> None:
    # make bench's rule (half a second of publishing) would allow no backlog at 0.24/s.
    assert kept_up(0.24, 1, "2s") is True
    assert kept_up(0.24, 2, "2s") is False
    assert kept_up(100.0, 50, "0") is True
    assert kept_up(100.0, 51, "0") is False
    assert kept_up(100.0, None, "0") is None


def _drained(rate: float, run: int = 1) -> Measurement:
    return Measurement(
        "service",
        run,
        800,
        rate=rate,
        cpu={"machine": 90.0},
        extra={"workers": 4.0, "batch_size": 1.0},
    )


def _paced(rate: float, p99: float, backlog: int, run: int = 1) -> Measurement:
    return Measurement(
        "service",
        run,
        100,
        rate=rate,
        extra={"p50_ms": p99 / 4, "p99_ms": p99, "backlog_at_end": backlog, "samples": 90},
    )


def test_a_cell_keeps_the_medians_and_whether_the_paced_run_kept_up() -> None:
    cell = summarize_cell("0", 400, [_drained(300.0), _drained(500.0, 2)], [_paced(150.0, 40.0, 3)])
    assert cell["throughput"]["median"] == 400.0
    assert cell["p99_ms"]["median"] == 40.0
    assert cell["kept_up"] is True
    assert cell["chose"] == [{"workers": 4.0, "batch_size": 1.0}] * 2

    behind = summarize_cell("0", 10, [_drained(130.0)], [_paced(65.0, 1800.0, 89)])
    assert behind["kept_up"] is False


def test_the_table_has_a_line_per_cell_and_its_errors() -> None:
    failed = Measurement("service", 1, 0, error="no throughput to pace at")
    cells = [
        summarize_cell("0", 1, [_drained(58.0)], [_paced(29.0, 115.5, 1)]),
        summarize_cell("2s", 1, [Measurement("service", 1, 6, error="exited 1\ntrace")], [failed]),
    ]
    lines = queue_row_lines(cells, runs=1)
    first = ["0", "1", "800", "58.0", "29.0", "28.9", "115.5", "yes", "90", "w4", "b1"]
    assert lines[2].split() == first
    assert lines[3].split()[:8] == ["2s", "1", "6", "-", "-", "-", "-", "-"]
    assert lines[4:] == [
        "    ! throughput run 1: exited 1",
        "    ! latency run 1: no throughput to pace at",
    ]
