"""The prune-load benchmark's pure parts: the retention aimed at one partition, the rounds counted
in the measured window, the modes and the ratio against the goal."""

from __future__ import annotations

import pytest

from bench.measure import Measurement
from bench.prune_load import GOAL, Round, parse_modes, retention_reaching, rounds_within, summarize
from bench.receipts import dropped_partitions
from consumer.durations import parse_duration


def test_the_retention_reaches_the_partition_in_whole_seconds_rounded_down() -> None:
    # A partition goes once its upper bound is at least the retention old: rounding down keeps
    # it reached (and its age only grows until the round runs).
    assert retention_reaching(172_800.9) == "172800s"
    assert parse_duration(retention_reaching(90_000.2)).total_seconds() == 90_000


def test_a_partition_that_has_not_ended_cannot_be_aimed_at() -> None:
    with pytest.raises(ValueError, match="ended"):
        retention_reaching(0.5)


def test_rounds_are_counted_when_they_overlap_the_window_and_busy_is_their_share() -> None:
    rounds = [
        Round(started=0.0, ended=2.0, dropped=1),  # partly before the window
        Round(started=2.0, ended=4.0, dropped=1),
        Round(started=9.0, ended=12.0, dropped=0),  # partly after it
        Round(started=12.0, ended=13.0, dropped=1),  # wholly after it
    ]
    found = rounds_within(rounds, [1.0, 10.0])
    assert found == {"rounds": 3, "drops": 2, "busy": round((1 + 2 + 1) / 9, 3)}


def test_no_window_no_rounds() -> None:
    assert rounds_within([Round(0.0, 1.0, 1)], None) == {"rounds": 0, "drops": 0, "busy": 0.0}


def test_modes_keep_their_canonical_order_and_refuse_unknown_ones() -> None:
    assert parse_modes("prune, without") == ("without", "prune")
    with pytest.raises(ValueError, match="choose from"):
        parse_modes("prune,sometimes")
    with pytest.raises(ValueError, match="choose from"):
        parse_modes(" , ")


def _runs(mode: str, rates: list[float]) -> list[Measurement]:
    return [Measurement(mode, run, 100, rate=rate) for run, rate in enumerate(rates, 1)]


def test_the_ratio_is_of_the_medians_and_judged_against_the_goal() -> None:
    found = summarize(
        {
            "without": _runs("without", [1000.0, 1200.0, 1100.0]),
            "prune": _runs("prune", [990.0, 1010.0, 800.0]),
            "dry-run": _runs("dry-run", [500.0]),
        }
    )
    assert found["ratios"] == {"prune_over_without": 0.9, "dry-run_over_without": 0.455}
    assert found["goal"] == GOAL
    assert found["goal_met"] is True
    assert summarize({"without": _runs("without", [1000.0])})["goal_met"] is None


def test_the_partitions_a_prune_dropped_are_read_from_its_output() -> None:
    output = (
        "created 3 partitions ahead\n"
        "dropped receipts_p20261124 [2026-11-24T00:00:00+00:00, 2026-11-25T00:00:00+00:00),"
        " about 10 receipts\n"
        "dropped receipts_legacy [-infinity, -infinity), about 0 receipts\n"
        "kept: 9 partitions, about 0 receipts"
    )
    assert dropped_partitions(output) == ["receipts_p20261124", "receipts_legacy"]
    assert dropped_partitions("would drop receipts_p20261124 [...), about 1 receipts") == []
