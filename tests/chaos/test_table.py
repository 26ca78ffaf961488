"""The queue-table scenarios' isolation figures from commit and publication times (pure)."""

from __future__ import annotations

from tests.chaos.table import Window, window_of


def test_a_window_counts_what_committed_and_what_was_published_in_it_and_their_waits() -> None:
    # Given commits at 1..4 and three publications in [0, 2) waiting 0.1s, 0.2s and 5s
    commits = [1.0, 2.0, 3.0, 4.0]
    waits = [(0.0, 0.1), (0.5, 5.0), (1.5, 0.2), (2.5, 0.3)]

    # When the window is [0, 2)
    window = window_of(commits, waits, 0.0, 2.0)

    # Then: one commit in 2s, three publications in 2s, their median wait and the worst
    assert window.effects == 0.5
    assert window.published == 1.5
    assert window.wait_median == 0.2
    assert window.wait_p95 == 5.0


def test_an_empty_or_backward_window_has_no_rates_and_no_waits() -> None:
    nothing = Window(effects=0.0, published=0.0, wait_median=None, wait_p95=None)
    assert window_of([1.0], [(1.0, 0.1)], 3.0, 3.0) == nothing
    assert window_of([], [], 0.0, 1.0) == nothing
