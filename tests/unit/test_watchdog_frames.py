"""What the hard time limit's log line says about the event the blocked loop was applying."""

from __future__ import annotations

import sys
import uuid
from types import SimpleNamespace
from typing import Any

from consumer.watchdog import event_in_frame


def _item(n: int) -> SimpleNamespace:
    return SimpleNamespace(
        event=SimpleNamespace(event_id=uuid.UUID(int=n), type="t.x"),
        delivery=SimpleNamespace(message_id=f"m-{n}"),
        handler=SimpleNamespace(qualname="handlers.x"),
    )


# Named as the pipeline's frames are: the watchdog finds them by name on the loop's stack.
def _run_handler(item: Any) -> dict[str, Any]:
    return _blocked_inside()


def _run_batch_handler(items: list[Any]) -> dict[str, Any]:
    return _blocked_inside()


def _blocked_inside() -> dict[str, Any]:
    return event_in_frame(sys._getframe())


def test_a_handler_of_one_event_is_named_with_its_event() -> None:
    assert _run_handler(_item(1)) == {
        "event_id": str(uuid.UUID(int=1)),
        "type": "t.x",
        "message_id": "m-1",
        "handler": "handlers.x",
    }


def test_a_batch_handler_is_named_with_its_first_event_and_the_batch_size() -> None:
    found = _run_batch_handler([_item(7), _item(8), _item(9)])
    assert found["event_id"] == str(uuid.UUID(int=7))
    assert found["handler"] == "handlers.x"
    assert found["batch_events"] == 3


def test_outside_a_handler_it_says_nothing() -> None:
    assert _blocked_inside() == {}
