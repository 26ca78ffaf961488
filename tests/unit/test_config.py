"""Each component's configuration as derived from the settings."""

from __future__ import annotations

import pytest

from consumer.config.settings import Settings
from consumer.service.components import MAX_BATCH_SIZE, batch_size, worker_count


@pytest.mark.parametrize(
    ("prefetch", "pool", "expected"),
    [
        (2000, 4, 4),
        (1600, 4, 4),
        (1200, 4, 3),
        (800, 4, 2),
        (800, 1, 1),
        (799, 4, 1),
        (400, 4, 1),
        (50, 4, 1),
        (10, 4, 1),
    ],
)
def test_the_workers_follow_from_the_prefetch_window(
    prefetch: int, pool: int, expected: int
) -> None:
    # One per eight full batches the window holds, at most the pool: fewer, fuller transactions
    assert worker_count(Settings(prefetch=prefetch, db_pool_size=pool)) == expected


def test_workers_that_are_set_are_kept() -> None:
    assert worker_count(Settings(prefetch=10, db_pool_size=4, workers=3)) == 3
    assert batch_size(Settings(prefetch=10, db_pool_size=4, workers=2)) == 5


@pytest.mark.parametrize(
    ("prefetch", "pool", "expected"),
    [(400, 4, MAX_BATCH_SIZE), (50, 4, 50), (10, 4, 10), (1, 4, 1), (120, 4, 50), (3, 1, 3)],
)
def test_the_batch_size_is_the_workers_share_of_the_prefetch_window(
    prefetch: int, pool: int, expected: int
) -> None:
    # A batch that waited for more than the window lets in would wait for nothing
    settings = Settings(prefetch=prefetch, db_pool_size=pool)
    assert batch_size(settings) == expected


def test_a_batch_size_that_is_set_is_kept() -> None:
    assert batch_size(Settings(prefetch=10, db_pool_size=4, batch_size=25)) == 25
