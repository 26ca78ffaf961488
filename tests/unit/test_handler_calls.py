"""What the watchdog learns, from another thread, about the handler call a blocked loop is in."""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any, cast

from pydantic import TypeAdapter

from consumer.pipeline.calls import HandlerCall, HandlerCaller, HandlerCalls
from consumer.pipeline.handler_time import HandlerTime
from consumer.pipeline.ready import Ready
from consumer.registry import Handler


def _call(n: int, events: int = 1) -> HandlerCall:
    return HandlerCall(
        handler="handlers.x",
        event_type="t.x",
        event_ids=tuple(uuid.UUID(int=n + i) for i in range(events)),
        message_id=f"m-{n}",
    )


def _seen_from_another_thread(calls: HandlerCalls, loop: asyncio.AbstractEventLoop) -> object:
    found: list[object] = []
    thread = threading.Thread(target=lambda: found.append(calls.running(loop)))
    thread.start()
    thread.join()
    return found[0]


async def test_the_call_whose_task_blocks_the_loop_is_named_not_another_open_one() -> None:
    calls = HandlerCalls()
    loop = asyncio.get_running_loop()
    waiting = asyncio.Event()
    seen: list[object] = []

    async def other_worker() -> None:
        with calls.entered(_call(100)):
            await waiting.wait()  # open, but not the one running

    async def blocking_worker() -> None:
        with calls.entered(_call(1)):
            time.sleep(0)  # the loop is in this task now
            seen.append(_seen_from_another_thread(calls, loop))

    other = asyncio.create_task(other_worker())
    await asyncio.sleep(0)
    await asyncio.create_task(blocking_worker())
    waiting.set()
    await other
    assert seen == [_call(1)]


async def test_outside_a_handler_call_nothing_is_named() -> None:
    calls = HandlerCalls()
    with calls.entered(_call(1)):
        pass
    assert _seen_from_another_thread(calls, asyncio.get_running_loop()) is None


def test_a_call_describes_itself_for_the_log_line() -> None:
    assert _call(7).describe() == {
        "event_id": str(uuid.UUID(int=7)),
        "type": "t.x",
        "message_id": "m-7",
        "handler": "handlers.x",
    }
    assert _call(7, events=3).describe()["batch_events"] == 3


class _OpenTransaction:
    """What the caller asks of a connection after a call that went well."""

    def is_in_transaction(self) -> bool:
        return True


def _ready(handler: Handler) -> Ready:
    event = SimpleNamespace(event_id=uuid.UUID(int=1), type="t.x")
    delivery = SimpleNamespace(message_id="m-1")
    return Ready(cast(Any, delivery), handler, cast(Any, event))


async def test_a_batch_handlers_single_event_is_tallied_as_a_batch_handlers_call() -> None:
    async def many(events: Sequence[Any], conn: Any) -> list[Exception | None]:
        return [None] * len(events)

    async def one(event: Any, conn: Any) -> None:
        return None

    adapter: TypeAdapter[Any] = TypeAdapter(dict)
    batch_handler = Handler("t.x", one, adapter, many=many)
    event_handler = Handler("t.x", one, adapter)
    tally = HandlerTime()
    caller = HandlerCaller(default_timeout=5, calls=HandlerCalls(), handler_time=tally)
    conn = cast(Any, _OpenTransaction())
    # A run of one of a batch handler goes through its per-event form: still a batch handler's
    # call, so the concurrency policy keeps it at the batch handlers' choice.
    await caller.run(conn, _ready(batch_handler))
    await caller.run_batch(conn, [_ready(batch_handler), _ready(batch_handler)])
    await caller.run(conn, _ready(event_handler))
    tally.batch(events=4, seconds=0.01, cpu=0.001)
    window = tally.take()
    assert window.batch_handler_calls == 2
    assert window.event_calls == 1
