from datetime import timedelta

import pytest

from consumer.durations import format_duration, parse_duration, to_milliseconds


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("500ms", timedelta(milliseconds=500)),
        ("5s", timedelta(seconds=5)),
        ("2m", timedelta(minutes=2)),
        ("1h", timedelta(hours=1)),
        ("1.5s", timedelta(seconds=1.5)),
        ("7", timedelta(seconds=7)),
        (" 10S ", timedelta(seconds=10)),
        (3, timedelta(seconds=3)),
    ],
)
def test_parses_units_and_bare_seconds(text: object, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize("text", ["", "5x", "-1s", "s", "1 2s", "1e3", True, None, -4])
def test_rejects_what_is_not_a_duration(text: object) -> None:
    with pytest.raises(ValueError, match=r"duration|negative"):
        parse_duration(text)


@pytest.mark.parametrize(
    ("delay", "text"),
    [
        (timedelta(milliseconds=200), "200ms"),
        (timedelta(milliseconds=1500), "1500ms"),
        (timedelta(seconds=1), "1s"),
        (timedelta(seconds=90), "90s"),
        (timedelta(minutes=2), "2m"),
        (timedelta(minutes=10), "10m"),
        (timedelta(hours=2), "2h"),
    ],
)
def test_formats_the_shortest_exact_spelling(delay: timedelta, text: str) -> None:
    assert format_duration(delay) == text
    assert parse_duration(text) == delay


def test_milliseconds_are_whole() -> None:
    assert to_milliseconds(timedelta(seconds=1.25)) == 1250
