"""The acks that remove exactly the letters a replay settled: one ``multiple`` ack for a run from
the oldest unacked delivery, single acks behind a delivery that stays."""

from __future__ import annotations

import pytest

from consumer.amqp.ack_runs import AckPlan, AckRuns


def test_a_run_from_the_first_delivery_is_one_multiple_ack() -> None:
    runs = AckRuns()
    assert runs.plan([3, 1, 2]) == AckPlan(up_to=3, singles=())
    # The next run starts where the last ended
    assert runs.plan([4, 5]) == AckPlan(up_to=5, singles=())


def test_a_delivery_kept_in_between_is_never_covered() -> None:
    runs = AckRuns()
    # Given delivery 3 kept (not selected, refused or failed): it is never in a plan
    plan = runs.plan([1, 2, 4, 5])
    # Then the run stops before it, and what follows is acked tag by tag
    assert plan == AckPlan(up_to=2, singles=(4, 5))
    assert runs.plan([6, 7]) == AckPlan(up_to=None, singles=(6, 7))


def test_a_late_confirm_joins_the_run_over_tags_acked_singly_before() -> None:
    runs = AckRuns()
    # Given 2 and 3 confirmed (and acked alone) before 1
    assert runs.plan([2, 3]) == AckPlan(up_to=None, singles=(2, 3))
    # When 1 is confirmed: it acks alone, and the run passes over 2 and 3, already gone
    assert runs.plan([1]) == AckPlan(up_to=1, singles=())
    # Then 4 extends the run: a multiple ack up to 4 covers nothing still held
    assert runs.plan([4]) == AckPlan(up_to=4, singles=())


def test_a_gap_not_yet_confirmed_stops_the_run_until_it_is() -> None:
    runs = AckRuns()
    assert runs.plan([1, 3]) == AckPlan(up_to=1, singles=(3,))
    assert runs.plan([2, 4, 6]) == AckPlan(up_to=4, singles=(6,))


@pytest.mark.parametrize("again", [[2], [5], [1, 7]])
def test_a_tag_is_acked_once(again: list[int]) -> None:
    runs = AckRuns()
    runs.plan([1, 2, 5])
    with pytest.raises(ValueError, match="only once"):
        runs.plan(again)


def test_nothing_to_remove_is_no_ack() -> None:
    assert AckRuns().plan([]) == AckPlan(up_to=None, singles=())


def test_what_was_acked_is_known_without_a_tag_each() -> None:
    runs = AckRuns()
    runs.plan([1, 2, 3, 5])  # 4 is held: 5 is acked singly, behind it
    assert [tag for tag in range(1, 7) if runs.acked(tag)] == [1, 2, 3, 5]
    runs.plan([4])  # the run closes: everything up to 5 is below the floor now
    assert all(runs.acked(tag) for tag in range(1, 6))
    assert not runs.acked(6)
    assert not runs._above  # nothing remembered a tag at a time
