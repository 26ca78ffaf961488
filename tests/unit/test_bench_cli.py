"""The benchmark's command line: the latency and prefetch tables' flags, receipts' --partition,
prune-load's modes."""

from __future__ import annotations

from datetime import timedelta

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


def test_receipts_partition_defaults_to_the_settings_and_takes_a_duration() -> None:
    assert parser().parse_args(["receipts"]).partition == timedelta(hours=1)
    assert parser().parse_args(["receipts", "--partition", "1h"]).partition == timedelta(hours=1)


@pytest.mark.parametrize("value", ["0s", "1.5s", "7d", "soon"])
def test_receipts_partition_refuses_what_the_setting_or_the_prune_cannot_take(
    value: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        parser().parse_args(["receipts", "--partition", value])
    assert "--partition" in capsys.readouterr().err


def test_prune_load_runs_every_mode_by_default() -> None:
    arguments = parser().parse_args(["prune-load"])
    assert arguments.modes == ("without", "prune", "dry-run", "round")
    assert (arguments.days, arguments.rows_per_day, arguments.every) == (4, 1_000_000, 1.0)
    assert parser().parse_args(["prune-load", "--modes", "prune,without"]).modes == (
        "without",
        "prune",
    )
