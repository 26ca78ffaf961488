from datetime import timedelta

import pytest

from consumer.durations import parse_duration
from topology.durations import format_duration, to_milliseconds


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
        ("1m30s", timedelta(minutes=1, seconds=30)),
        ("1h30m", timedelta(hours=1, minutes=30)),
        ("1d", timedelta(days=1)),
        ("1d12h", timedelta(days=1, hours=12)),
        ("2m500ms", timedelta(minutes=2, milliseconds=500)),
        ("1H30M", timedelta(hours=1, minutes=30)),
    ],
)
def test_parses_units_and_bare_seconds(text: object, expected: timedelta) -> None:
    assert parse_duration(text) == expected


@pytest.mark.parametrize(
    "text",
    ["", "5x", "-1s", "s", "1 2s", "1e3", "30s1m", "1m1m", "1m 30s", "1m30", "ms", True, None, -4],
)
def test_rejects_what_is_not_a_duration(text: object) -> None:
    with pytest.raises(ValueError, match=r"duration|negative") as caught:
        parse_duration(text)
    # The value itself is left to whoever shows the message (the settings' line shows it once).
    assert repr(text) not in str(caught.value)


def test_a_compound_names_its_units_from_the_largest_down() -> None:
    with pytest.raises(ValueError, match="largest down"):
        parse_duration("30s1m")


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


@pytest.mark.parametrize(
    ("text", "name"), [("1m30s", "90s"), ("1d", "24h"), ("1h30m", "90m"), ("2m500ms", "120500ms")]
)
def test_a_compound_is_named_in_one_unit(text: str, name: str) -> None:
    # Queue names come from this: a ladder written 1m30s keeps the queue it had as 90s.
    assert format_duration(parse_duration(text)) == name


def test_milliseconds_are_whole() -> None:
    assert to_milliseconds(timedelta(seconds=1.25)) == 1250


@pytest.mark.parametrize("text", ["99999999999d", "9" * 400, 1e300])
def test_a_duration_too_long_for_a_timedelta_is_refused_as_a_bad_value(text: object) -> None:
    with pytest.raises(ValueError, match="too long"):
        parse_duration(text)
