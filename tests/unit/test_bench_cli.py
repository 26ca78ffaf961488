"""The benchmark's command line: the latency and prefetch tables' flags."""

from __future__ import annotations

import pytest

from bench.cli import parser


def test_one_invocation_runs_every_table_at_the_issues_rates_and_prefetches() -> None:
    arguments = parser().parse_args(["run"])
    assert not arguments.no_latency
    assert not arguments.no_prefetch
    assert arguments.latency_rates == (500.0, 1000.0, 2000.0)
    assert arguments.prefetches == (10, 50, 400)


def test_each_table_can_be_skipped_and_its_points_chosen() -> None:
    arguments = parser().parse_args(
        ["run", "--no-latency", "--no-prefetch", "--latency-rates", "750,1500", "--prefetches", "1"]
    )
    assert arguments.no_latency
    assert arguments.no_prefetch
    assert arguments.latency_rates == (750.0, 1500.0)
    assert arguments.prefetches == (1,)


@pytest.mark.parametrize(
    ("flag", "value"),
    [
        ("--prefetches", "10,x"),
        ("--prefetches", "0"),
        ("--prefetches", "2.5"),
        ("--latency-rates", ""),
    ],
)
def test_a_bad_list_stops_with_the_flags_name(
    flag: str, value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["run", flag, value])
    assert flag in capsys.readouterr().err
