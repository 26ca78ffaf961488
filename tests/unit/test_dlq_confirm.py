"""``dlq purge`` asks on a terminal, and only there."""

from __future__ import annotations

import io

import pytest

from consumer.cli.dlq.main import confirmed


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.mark.parametrize(
    ("typed", "expected"), [("yes\n", True), (" YES \n", True), ("y\n", False)]
)
def test_only_yes_on_a_terminal_confirms(
    monkeypatch: pytest.MonkeyPatch, typed: str, expected: bool
) -> None:
    monkeypatch.setattr("sys.stdin", Terminal(typed))

    assert confirmed("Delete? ") is expected


def test_end_of_input_on_a_terminal_is_no(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("sys.stdin", Terminal(""))

    assert confirmed("Delete? ") is False


@pytest.mark.parametrize("stdin", [io.StringIO("yes\n"), None])
def test_without_a_terminal_it_stops_with_exit_2_and_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], stdin: io.StringIO | None
) -> None:
    monkeypatch.setattr("sys.stdin", stdin)

    with pytest.raises(SystemExit) as caught:
        confirmed("Delete? ")

    assert caught.value.code == 2
    assert capsys.readouterr().err == (
        "error: dlq purge asks before deleting and there is no terminal to ask on: add --yes\n"
    )
