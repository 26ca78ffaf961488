"""The start-up self-test of the decoders installed in pamqp's place (issue 29, "pamqp internals"):
it passes with them, names the way a frame is read that does not refuse, and stops ``consumer
run`` with one line."""

from __future__ import annotations

import os
from collections.abc import Iterator
from types import SimpleNamespace
from typing import Any

import pytest
from pamqp import decode

from bench.hostile import pristine_pamqp_decode
from consumer.amqp import frames, wire
from consumer.amqp.field_table import TableLimits
from consumer.cli.main import main
from consumer.errors import IncompatibleLibrary


def _pristine_field_table() -> Any:
    return pristine_pamqp_decode().field_table


@pytest.fixture
def installed() -> Iterator[None]:
    """The decoders installed, and installed again afterwards whatever a test undid."""
    wire.install()
    saved = dict(decode.METHODS)
    yield
    decode.METHODS.clear()
    decode.METHODS.update(saved)
    wire.install()


@pytest.mark.parametrize(
    "limits",
    [TableLimits(), TableLimits(max_bytes=1024), TableLimits(max_bytes=1 << 20, max_entries=64)],
    ids=["defaults", "smallest-setting", "many-bytes-few-entries"],
)
def test_the_installed_decoders_pass(limits: TableLimits) -> None:
    wire.install(limits)
    try:
        wire.self_test(limits)
    finally:
        wire.install()


@pytest.mark.usefixtures("installed")
def test_pamqps_own_table_decoder_fails_it_naming_the_path_and_the_case() -> None:
    # What a pamqp release that reads tables another way would leave in place.
    decode.METHODS["table"] = _pristine_field_table()

    with pytest.raises(IncompatibleLibrary) as failed:
        wire.self_test(TableLimits())

    message = str(failed.value)
    assert "\n" not in message
    assert "pamqp's decode.by_type decoded it instead of refusing a table nested 17 deep" in message


@pytest.mark.usefixtures("installed")
def test_a_fast_path_that_reads_tables_its_own_way_fails_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The fast path alone reading tables with pamqp's own decoder; pamqp's paths are protected.
    unprotected = {**decode.METHODS, "table": _pristine_field_table()}
    monkeypatch.setattr(frames, "decode", SimpleNamespace(METHODS=unprotected))

    with pytest.raises(IncompatibleLibrary) as failed:
        wire.self_test(TableLimits())

    assert "the fast path (consumer.amqp.frames) " in str(failed.value)


@pytest.mark.usefixtures("installed")
def test_consumer_run_stops_with_one_line_and_exit_2(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    for key in list(os.environ):
        if key.upper().startswith("CONSUMER_"):
            monkeypatch.delenv(key)
    # install() does nothing, and pamqp's own decoder stays: the limits would not hold.
    monkeypatch.setattr(wire, "install", lambda limits=None: None)
    decode.METHODS["table"] = _pristine_field_table()

    with pytest.raises(SystemExit) as stopped:
        main(["run"])

    assert stopped.value.code == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1
    assert lines[0].startswith("error: the AMQP header decoders do not hold the service's limits")
