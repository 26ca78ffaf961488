"""``Deadline`` limits one block as ``asyncio.timeout`` does: each case runs under both.

Limits are a few hundredths of a second, so that the whole module takes well under a second.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager, suppress
from typing import Any

import pytest

from consumer.deadlines import Deadline

Limit = Callable[[float], AbstractAsyncContextManager[Any]]

LIMITS = [
    pytest.param(asyncio.timeout, id="asyncio.timeout"),
    pytest.param(Deadline, id="Deadline"),
]
SHORT = 0.01
LONG = 10.0


def expired(limit: Any) -> bool:
    # asyncio.Timeout says it with a method, Deadline with an attribute.
    return bool(limit.expired()) if isinstance(limit, asyncio.Timeout) else bool(limit.expired)


def this_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    assert task is not None
    return task


@pytest.mark.parametrize("limit", LIMITS)
async def test_a_block_past_its_limit_raises_timeout_error(limit: Limit) -> None:
    with pytest.raises(TimeoutError):
        async with limit(SHORT) as entered:
            await asyncio.sleep(LONG)
    assert expired(entered)


@pytest.mark.parametrize("limit", LIMITS)
async def test_a_block_done_in_time_leaves_no_cancellation_behind(limit: Limit) -> None:
    cancelling = this_task().cancelling()
    async with limit(SHORT) as entered:
        await asyncio.sleep(0)
    assert not expired(entered)
    assert this_task().cancelling() == cancelling
    # The limit's timer is gone: waiting past the time it would have fired is not cancelled.
    await asyncio.sleep(0)
    await asyncio.sleep(SHORT * 3)
    assert not expired(entered)


@pytest.mark.parametrize("limit", LIMITS)
async def test_an_expired_limit_leaves_the_task_as_it_found_it(limit: Limit) -> None:
    cancelling = this_task().cancelling()
    with pytest.raises(TimeoutError):
        async with limit(SHORT):
            await asyncio.sleep(LONG)
    assert this_task().cancelling() == cancelling
    await asyncio.sleep(0)  # not cancelled: the limit's own cancellation was taken back


@pytest.mark.parametrize("limit", LIMITS)
async def test_a_cancel_from_another_task_stays_a_cancellation(limit: Limit) -> None:
    limits: list[Any] = []

    async def limited() -> None:
        async with limit(LONG) as entered:
            limits.append(entered)
            await asyncio.sleep(LONG)

    victim = asyncio.create_task(limited())
    await asyncio.sleep(0)
    victim.cancel()
    with pytest.raises(asyncio.CancelledError):
        await victim
    assert not expired(limits[0])


@pytest.mark.parametrize("limit", LIMITS)
async def test_a_cancel_arriving_as_the_limit_passes_stays_a_cancellation(limit: Limit) -> None:
    limits: list[Any] = []

    async def limited() -> None:
        async with limit(SHORT) as entered:
            limits.append(entered)
            await asyncio.sleep(LONG)

    victim = asyncio.create_task(limited())
    await asyncio.sleep(0)
    time.sleep(SHORT * 3)  # hold the loop: the limit's timer is due on the next turn...
    await asyncio.sleep(0)
    victim.cancel()  # ...where it fires just after this, before the victim runs again
    with pytest.raises(asyncio.CancelledError):
        await victim
    assert expired(limits[0])


@pytest.mark.parametrize("limit", LIMITS)
async def test_an_inner_limit_expiring_leaves_the_outer_block_running(limit: Limit) -> None:
    async with limit(LONG) as outer:
        with pytest.raises(TimeoutError):
            async with limit(SHORT) as inner:
                await asyncio.sleep(LONG)
        await asyncio.sleep(0)  # the outer block goes on, not cancelled
        reached_the_end = True
    assert reached_the_end
    assert expired(inner)
    assert not expired(outer)


@pytest.mark.parametrize("limit", LIMITS)
async def test_an_outer_limit_expiring_inside_an_inner_one_is_the_outers(limit: Limit) -> None:
    # The inner block sees a cancellation it did not ask for and lets it through.
    limits: dict[str, Any] = {}
    inner_saw: list[type[BaseException]] = []

    async def nested() -> None:
        async with limit(SHORT) as limits["outer"]:
            try:
                async with limit(LONG) as limits["inner"]:
                    await asyncio.sleep(LONG)
            except BaseException as error:
                inner_saw.append(type(error))
                raise

    with pytest.raises(TimeoutError):
        await nested()
    assert inner_saw == [asyncio.CancelledError]
    assert expired(limits["outer"])
    assert not expired(limits["inner"])


@pytest.mark.parametrize("limit", LIMITS)
async def test_an_error_in_the_block_passes_through_unchanged(limit: Limit) -> None:
    error = ValueError("the handler's own")
    with pytest.raises(ValueError, match="the handler's own") as raised:
        async with limit(LONG) as entered:
            raise error
    assert raised.value is error
    assert not expired(entered)


@pytest.mark.parametrize("limit", LIMITS)
async def test_an_error_raised_once_the_limit_passed_passes_through(limit: Limit) -> None:
    # A block that turns the limit's cancellation into an error of its own keeps that error.
    limits: list[Any] = []

    async def cleanup_fails() -> None:
        async with limit(SHORT) as entered:
            limits.append(entered)
            try:
                await asyncio.sleep(LONG)
            except asyncio.CancelledError:
                raise KeyError("cleanup failed") from None

    with pytest.raises(KeyError):
        await cleanup_fails()
    assert expired(limits[0])


@pytest.mark.parametrize("limit", LIMITS)
async def test_a_block_that_swallows_the_limits_cancellation_ends_quietly(limit: Limit) -> None:
    cancelling = this_task().cancelling()
    async with limit(SHORT) as entered:
        with suppress(asyncio.CancelledError):
            await asyncio.sleep(LONG)
    assert expired(entered)
    assert this_task().cancelling() == cancelling
    await asyncio.sleep(0)


@pytest.mark.parametrize("limit", LIMITS)
async def test_a_limit_entered_while_the_task_is_being_cancelled_still_times_out(
    limit: Limit,
) -> None:
    # Clean-up after a caught cancellation (not taken back) still gets its own TimeoutError.
    async def cleanup_after_a_cancel() -> str:
        try:
            await asyncio.sleep(LONG)
        except asyncio.CancelledError:
            try:
                async with limit(SHORT):
                    await asyncio.sleep(LONG)
            except TimeoutError:
                return "timed out"
        return "not cancelled"

    task = asyncio.create_task(cleanup_after_a_cancel())
    await asyncio.sleep(0)
    task.cancel()
    assert await task == "timed out"


async def test_deadline_and_asyncio_timeout_end_the_same_nested_blocks_the_same_way() -> None:
    # One scenario, both limits, the record of what each block saw compared whole.
    async def scenario(limit: Limit) -> list[str]:
        seen: list[str] = []
        before = this_task().cancelling()
        async with limit(LONG):
            for inner_seconds in (SHORT, LONG):
                try:
                    async with limit(inner_seconds):
                        await asyncio.sleep(SHORT * 2)
                    seen.append("done")
                except TimeoutError:
                    seen.append("timeout")
        seen.append(f"cancels left: {this_task().cancelling() - before}")
        return seen

    assert await scenario(Deadline) == await scenario(asyncio.timeout)
    assert await scenario(Deadline) == ["timeout", "done", "cancels left: 0"]
