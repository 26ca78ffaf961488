"""The contract between the service's hooks and aiormq's and pamqp's private code
(:mod:`consumer.amqp.fast_paths`): it holds for the installed versions, and where it does not the
check names the hook and what differs, and the hook stays out."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import aiormq.channel
import aiormq.connection
import pytest
from pamqp import decode

from consumer.amqp import fast_paths
from consumer.amqp.direct_consume import DirectDeliveryChannel
from consumer.amqp.fast_paths import DIRECT_CONSUME, FRAMES, WIRE
from consumer.amqp.field_table import TableDecoder
from consumer.amqp.frames import BulkFrameReceiver
from consumer.errors import IncompatibleLibrary
from consumer.service.app import _warn_of_refused_hooks

ORIGINAL_RECEIVER = BulkFrameReceiver.__mro__[1]
ORIGINAL_CHANNEL = DirectDeliveryChannel.__mro__[1]


@pytest.fixture(autouse=True)
def _as_it_was() -> Iterator[None]:
    """The process's aiormq as before the test: these tests install and uninstall."""
    receiver, channel = aiormq.connection.FrameReceiver, aiormq.connection.Channel  # type: ignore[attr-defined]
    yield
    aiormq.connection.FrameReceiver = receiver  # type: ignore[misc]
    aiormq.connection.Channel = channel  # type: ignore[attr-defined]


def _checked_again() -> dict[str, list[str]]:
    return fast_paths.problems.__wrapped__()


def test_the_installed_aiormq_and_pamqp_are_what_every_hook_replaces() -> None:
    found = _checked_again()

    assert found == {}, "\n".join(
        f"{hook}: {problem}" for hook, p in found.items() for problem in p
    )


def test_a_decoder_pamqp_no_longer_has_is_named_under_the_wire_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delitem(decode.METHODS, "shortstr")

    assert _checked_again() == {WIRE: ["pamqp.decode.METHODS has no 'shortstr'"]}


def test_a_receiver_method_aiormq_renamed_is_named_under_the_frames_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delattr(ORIGINAL_RECEIVER, "get_frame")

    found = _checked_again()

    assert list(found) == [FRAMES]
    assert "aiormq.connection.FrameReceiver.get_frame is not there" in found[FRAMES]


def test_a_connection_that_builds_its_receiver_by_another_name_is_named(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def other(self: Any) -> None:
        return None

    monkeypatch.setattr(aiormq.connection.Connection, "connect", other)

    found = _checked_again()

    assert found == {FRAMES: ["aiormq.connection.Connection.connect no longer uses FrameReceiver"]}


def test_a_channel_method_with_another_signature_is_named_under_the_direct_consume_hook(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    async def on_deliver(self: Any, message: Any) -> None:
        return None

    monkeypatch.setattr(aiormq.channel.Channel, "_on_deliver_frame", on_deliver)

    assert _checked_again() == {
        DIRECT_CONSUME: [
            "aiormq.Channel._on_deliver_frame takes (self, message), not (self, frame)"
        ]
    }


def test_the_fast_path_off_leaves_aiormq_its_own_code_and_the_decoders_total() -> None:
    fast_paths.install(fast_path=True)
    assert aiormq.connection.FrameReceiver is BulkFrameReceiver
    assert aiormq.connection.Channel is DirectDeliveryChannel  # type: ignore[attr-defined]

    fast_paths.install(fast_path=False)

    assert aiormq.connection.FrameReceiver is ORIGINAL_RECEIVER
    assert aiormq.connection.Channel is ORIGINAL_CHANNEL  # type: ignore[attr-defined]
    # The hardened decoders are about safety, not speed: on either way.
    assert isinstance(getattr(decode.METHODS["table"], "__self__", None), TableDecoder)
    assert fast_paths.refused(fast_path=False) == {}


def test_a_hook_whose_check_fails_is_left_out_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    fast_paths.install(fast_path=False)
    differs = {FRAMES: ["aiormq.connection.FrameReceiver.get_frame is not there"]}
    monkeypatch.setattr(fast_paths, "problems", lambda: differs)

    fast_paths.install(fast_path=True)

    assert aiormq.connection.FrameReceiver is ORIGINAL_RECEIVER
    assert aiormq.connection.Channel is DirectDeliveryChannel  # type: ignore[attr-defined]
    assert fast_paths.refused(fast_path=True) == differs
    assert fast_paths.refused(fast_path=False) == {}


def test_a_pamqp_the_decoders_do_not_fit_stops_whoever_connects_with_one_line(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    differs = {WIRE: ["pamqp.decode.METHODS has no 'table'"]}
    monkeypatch.setattr(fast_paths, "problems", lambda: differs)

    with pytest.raises(IncompatibleLibrary, match="METHODS has no 'table'"):
        fast_paths.install(fast_path=False)
    assert fast_paths.refused(fast_path=True) == {}  # not a fast path: no fallback, a stop


class _Recorded:
    def __init__(self) -> None:
        self.warnings: list[tuple[str, dict[str, Any]]] = []

    def warning(self, event: str, **fields: Any) -> None:
        self.warnings.append((event, fields))


def test_start_up_says_in_one_line_which_hook_fell_back(monkeypatch: pytest.MonkeyPatch) -> None:
    differs = {DIRECT_CONSUME: ["aiormq.Channel._get_frame is not there"]}
    monkeypatch.setattr(fast_paths, "problems", lambda: differs)
    logger, quiet = _Recorded(), _Recorded()

    _warn_of_refused_hooks(logger, fast_path=True)  # type: ignore[arg-type]
    _warn_of_refused_hooks(quiet, fast_path=False)  # type: ignore[arg-type]

    ((event, fields),) = logger.warnings
    assert "private code differs" in event
    assert fields == {
        "hooks": [DIRECT_CONSUME],
        "differences": [f"{DIRECT_CONSUME}: aiormq.Channel._get_frame is not there"],
    }
    assert quiet.warnings == []
