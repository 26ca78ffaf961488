"""The relay's resting rows: refused rows left out of the claims for a while that doubles, with
their keys, and forgotten once sent, failed for good, or long unseen."""

from __future__ import annotations

from consumer.service.outbox_resting import RestingRows


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_a_refused_row_and_its_key_rest_for_the_first_wait_then_come_back() -> None:
    clock = Clock()
    resting = RestingRows(0.5, 4.0, clock)
    resting.refused(7, "K")
    resting.refused(8, None)
    skipped = resting.skipped()
    assert sorted(skipped.ids) == [7, 8]
    assert skipped.keys == ["K"]
    clock.now += 0.6
    assert resting.skipped().ids == []


def test_each_refusal_in_a_row_doubles_the_rest_up_to_the_ceiling() -> None:
    clock = Clock()
    resting = RestingRows(1.0, 3.0, clock)
    rests = []
    for _ in range(4):
        resting.refused(1, None)
        start = clock.now
        while resting.skipped().ids:
            clock.now += 0.25
        rests.append(clock.now - start)
    assert rests == [1.0, 2.0, 3.0, 3.0]


def test_a_row_sent_or_failed_for_good_rests_no_more() -> None:
    clock = Clock()
    resting = RestingRows(1.0, 3.0, clock)
    resting.refused(1, "K")
    resting.done(1)
    assert resting.skipped().ids == []
    assert resting.skipped().keys == []


def test_a_row_unseen_for_a_ceiling_after_its_rest_is_forgotten() -> None:
    clock = Clock()
    resting = RestingRows(1.0, 3.0, clock)
    resting.refused(1, None)
    resting.refused(1, None)  # a rest of 2 s now
    clock.now += 2.0 + 3.0 + 0.1
    assert resting.skipped().ids == []
    resting.refused(1, None)  # counted afresh: the first rest again
    clock.now += 1.1
    assert resting.skipped().ids == []
