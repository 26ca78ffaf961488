"""Reading ``traceparent`` and ``tracestate`` from a producer's headers: a valid context, or
nothing; hostile values are ignored, never a failure."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from consumer.amqp.wire import HeaderTooDeep, UnreadableHeader
from consumer.observe.traceparent import (
    MAX_TRACESTATE,
    TraceParent,
    format_traceparent,
    read_traceparent,
    read_tracestate,
)

TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
SPAN = "00f067aa0ba902b7"
VALID = f"00-{TRACE}-{SPAN}-01"


def test_a_valid_traceparent_is_read() -> None:
    parent = read_traceparent({"traceparent": VALID})

    assert parent == TraceParent(int(TRACE, 16), int(SPAN, 16), 1)
    assert parent is not None
    assert parent.sampled


def test_bytes_and_surrounding_blanks_are_read_too() -> None:
    assert read_traceparent({"traceparent": f" {VALID}\t".encode()}) is not None


def test_a_future_version_may_carry_more_fields() -> None:
    parent = read_traceparent({"traceparent": f"cc-{TRACE}-{SPAN}-00-what-comes-next"})

    assert parent == TraceParent(int(TRACE, 16), int(SPAN, 16), 0)
    assert not parent.sampled


@pytest.mark.parametrize(
    "value",
    [
        None,
        "",
        "garbage",
        "00-garbage",
        f"ff-{TRACE}-{SPAN}-01",  # version ff is invalid
        f"0-{TRACE}-{SPAN}-01",
        f"zz-{TRACE}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-01-extra",  # version 00 has exactly four fields
        f"00-{TRACE.upper()}-{SPAN}-01",  # lowercase hex only
        f"00-{'0' * 32}-{SPAN}-01",  # all-zero trace id
        f"00-{TRACE}-{'0' * 16}-01",  # all-zero parent id
        f"00-{TRACE[:-1]}-{SPAN}-01",
        f"00-{TRACE}-{SPAN}-1",
        f"00-{TRACE}-{SPAN}-0x",
        f"00_{TRACE}_{SPAN}_01",
        f"01-{TRACE}-{SPAN}-01-" + "x" * 10_000,  # too long to be anything legitimate
        b"\xff\xfe" * 40,
        12345,
        ["00", TRACE, SPAN, "01"],
        {"traceparent": VALID},
        UnreadableHeader("unreadable"),
        HeaderTooDeep("too deep"),
    ],
)
def test_what_is_not_a_valid_traceparent_is_ignored(value: Any) -> None:
    assert read_traceparent({"traceparent": value}) is None


def test_no_headers_no_parent() -> None:
    assert read_traceparent(None) is None
    assert read_traceparent({}) is None
    assert read_tracestate(None) is None


@given(st.one_of(st.text(max_size=400), st.binary(max_size=400), st.integers(), st.none()))
def test_reading_never_fails(value: object) -> None:
    read_traceparent({"traceparent": value, "tracestate": value})
    read_tracestate({"tracestate": value})


def test_written_as_version_00_and_read_back() -> None:
    text = format_traceparent(int(TRACE, 16), int(SPAN, 16), 1)

    assert text == VALID
    assert read_traceparent({"traceparent": text}) == TraceParent(int(TRACE, 16), int(SPAN, 16), 1)


def test_a_valid_tracestate_is_kept_member_by_member() -> None:
    headers = {"tracestate": "rojo=00f067aa0ba902b7, congo=t61rcWkgMzE,,tenant@vendor=x"}

    assert read_tracestate(headers) == [
        "rojo=00f067aa0ba902b7",
        "congo=t61rcWkgMzE",
        "tenant@vendor=x",
    ]


@pytest.mark.parametrize(
    "value",
    [
        "",
        "no-equals-sign",
        "Upper=1",
        "a=1,a=2",  # a key twice
        "a=has=equals",
        ",".join(f"k{i}=v" for i in range(33)),  # more than 32 members
        "a=" + "v" * MAX_TRACESTATE,  # too long to carry on
        b"\x00\x01",
        42,
    ],
)
def test_an_invalid_tracestate_is_dropped_whole(value: Any) -> None:
    assert read_tracestate({"tracestate": value}) is None
