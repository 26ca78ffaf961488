"""The shards benchmark's pure parts: which shards each process runs, where the measured window
ends, the ratios, the per-core figures and the scale model, from made-up cells (no broker, no
database)."""

from __future__ import annotations

from dataclasses import astuple
from typing import Any

import pytest

from bench.shard_figures import (
    assign_shards,
    consumer_channels,
    per_core,
    ratios,
    scale_inputs,
    scale_model,
    shard_lines,
    shards_label,
)
from bench.shards import queue_table, rotated, window_end


@pytest.mark.parametrize(
    ("processes", "shards", "expected"),
    [
        (1, 1, [None]),
        (1, 6, [None]),
        (3, 1, [None, None, None]),
        (3, 3, [(1,), (2,), (3,)]),
        (3, 6, [(1, 4), (2, 5), (3, 6)]),
        (6, 6, [(1,), (2,), (3,), (4,), (5,), (6,)]),
        (6, 3, [(1,), (2,), (3,), (1,), (2,), (3,)]),
        (2, 3, [(1, 3), (2,)]),
    ],
)
def test_shards_are_dealt_to_the_processes_in_turn(
    processes: int, shards: int, expected: list[tuple[int, ...] | None]
) -> None:
    assert assign_shards(processes, shards) == expected


def test_every_shard_is_run_and_the_processes_share_them_evenly() -> None:
    for processes in range(2, 8):
        for shards in range(2, 13):
            parts = assign_shards(processes, shards)
            run = [shard for part in parts for shard in part or ()]
            assert set(run) == set(range(1, shards + 1))
            sizes = [len(part or ()) for part in parts]
            assert max(sizes) - min(sizes) <= 1
            if shards >= processes:
                assert len(run) == shards  # no shard run twice


def test_no_process_or_shard_count_below_one() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        assign_shards(0, 3)


def test_labels_and_channels_of_an_assignment() -> None:
    assert shards_label(assign_shards(3, 6)) == "1,4 / 2,5 / 3,6"
    assert shards_label(assign_shards(1, 6)) == "all"
    assert shards_label(assign_shards(6, 1)) == "all x6"
    assert consumer_channels(assign_shards(1, 6), 6) == 6
    assert consumer_channels(assign_shards(6, 1), 1) == 6
    assert consumer_channels(assign_shards(6, 3), 3) == 6
    assert consumer_channels(assign_shards(3, 6), 6) == 6


def test_the_window_ends_while_the_queues_still_hold_more_than_the_consumers_windows() -> None:
    # 15% of the events when that is more than half again the prefetch windows
    assert window_end(30_000, 1, 400) == 25_500
    # else the windows: 6 consumers x 400, and half again
    assert window_end(15_000, 6, 400) == 15_000 - 3_600
    assert window_end(1_000, 6, 400) == 0


def test_the_table_shards_the_stock_queue_only_above_one_and_each_process_starts_elsewhere() -> (
    None
):
    assert "shards" not in queue_table(1)
    assert "shards = 6\n" in queue_table(6)
    urls = ["a", "b", "c"]
    assert [rotated(urls, i) for i in range(4)] == ["a,b,c", "b,c,a", "c,a,b", "a,b,c"]


def _cell(processes: int, shards: int, rate: float | None, **extra: Any) -> dict[str, Any]:
    return {"processes": processes, "shards": shards, "rate": rate, **extra}


def test_ratios_are_to_one_shard_at_the_same_process_count_and_to_one_by_one() -> None:
    cells = [_cell(1, 1, 1000), _cell(1, 3, 1500), _cell(3, 1, 1200), _cell(3, 3, 2400)]
    relative = ratios(cells)
    assert relative[(1, 3)] == {"vs_one_shard": 1.5, "vs_one_by_one": 1.5}
    assert relative[(3, 3)] == {"vs_one_shard": 2.0, "vs_one_by_one": 2.4}
    assert relative[(3, 1)] == {"vs_one_shard": 1.0, "vs_one_by_one": 1.2}
    assert ratios([_cell(3, 3, 2400)])[(3, 3)] == {"vs_one_shard": None, "vs_one_by_one": None}


def _measured(processes: int, shards: int) -> dict[str, Any]:
    """2,000 events/s: the service at 40% of a core, the nodes at 20% (10 + 5 + 5), PostgreSQL
    backends at 10%; 20,000 events in 400 transactions; published at 1,000/s with the nodes at
    60% (30 + 15 + 15)."""
    return _cell(
        processes,
        shards,
        2000.0,
        events=20_000,
        transactions=400,
        cpu={
            "service": 40.0,
            "beam": 20.0,
            "beam0": 10.0,
            "beam1": 5.0,
            "beam2": 5.0,
            "postgres": 10.0,
        },
        publish={
            "events": 20_000,
            "seconds": 20.0,
            "cpu": {"beam": 60.0, "beam0": 30.0, "beam1": 15.0, "beam2": 15.0},
        },
    )


def test_per_core_figures_come_from_the_rate_and_the_cpu_shares() -> None:
    figures = per_core(_measured(1, 1))
    assert figures == pytest.approx(
        {
            "service_events_per_core_s": 5000.0,  # 2,000/s on 0.4 of a core
            "stack_events_per_core_s": 2857.142857,  # 2,000/s on 0.4 + 0.2 + 0.1 of a core
            "beam_consume_ms": 0.1,  # 0.2 core-s a second / 2,000 events
            "beam_publish_ms": 0.6,  # 0.6 core-s a second / 1,000 events
            "leader_node_ms": 0.05,
            "leader_node_publish_ms": 0.3,
            "postgres_ms": 0.05,
            "postgres_commit_ms": 2.5,  # 50 events a commit
            "events_per_commit": 50.0,
            "commits_s": 40.0,
        }
    )
    assert per_core(_cell(1, 1, None)) == {}


def test_a_one_shard_queue_s_leader_node_is_the_one_it_names_not_the_busiest() -> None:
    # Given the one shard's leader on node 1, which was less busy than node 0
    cell = {**_measured(1, 1), "leaders": [1]}

    # Then the leader's figures are node 1's: 5% of a core at 2,000/s, 15% at 1,000/s published
    figures = per_core(cell)
    assert figures["leader_node_ms"] == pytest.approx(0.025)
    assert figures["leader_node_publish_ms"] == pytest.approx(0.15)


def test_the_scale_model_shows_its_arithmetic() -> None:
    inputs = scale_inputs([_measured(1, 1), _measured(3, 3)])
    assert inputs is not None
    assert astuple(inputs) == pytest.approx((5000.0, 0.7, 0.35, 0.05, 50.0))
    steps = dict(scale_model(inputs, target=100_000, headroom=0.5, node_cores=8))
    figures = list(steps.values())
    assert figures == pytest.approx(
        [
            40.0,  # service cores: 100,000 / 5,000 / 0.5
            40,  # processes
            1000 / 0.35 * 0.5,  # one leader's events/s
            70,  # shards for the leaders: 100,000 / 1,428.6, rounded up
            70,  # shards: max(70, 40)
            140.0,  # RabbitMQ cores: 100,000 x 0.7 ms / 1000 / 0.5
            18,  # nodes: max(3, 140 / 8 -> 18, 70 / 8 -> 9)
            2000.0,  # commits/s: 100,000 / 50
            10.0,  # PostgreSQL cores: 100,000 x 0.05 ms / 1000 / 0.5
        ]
    )
    assert any("100,000 / 5,000 events/s per core / 0.5" in step for step in steps)
    with pytest.raises(ValueError, match="headroom"):
        scale_model(inputs, headroom=1.5)


def test_the_table_has_a_row_per_cell_and_the_model_under_it() -> None:
    failed = {"processes": 6, "shards": 6, "error": "no progress"}
    result = {
        "events": 20_000,
        "skus": 10_000,
        "machine": "2 cores",
        "cells": [
            {**_measured(1, 1), "assignment": "all", "load": [1.0, 2.0]},
            {**_measured(3, 3), "assignment": "1 / 2 / 3", "load": [2.0, 3.0]},
            failed,
        ],
    }
    lines = shard_lines(result)
    assert (
        "| 1 | 1 | all | 2,000 | 1.00 | 1.00 | 40 | 20 | 10 | - | 5,000 | 2,857 | 50.0 | "
        "1.0 -> 2.0 |" in lines
    )
    assert "| 6 | 6 | FAILED: no progress |" in lines
    assert any(line.startswith("- service cores = 100,000") for line in lines)
