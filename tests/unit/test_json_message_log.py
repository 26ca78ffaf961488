"""``JsonMessageLog`` writes the line the structlog JSON logger writes, without structlog.

Both write into ``BytesIO`` through ``TickFlushed`` (outside a running loop it writes at once);
the lines are compared byte for byte with the timestamps masked: same keys in the same order,
same values, passwords in URLs scrubbed the same way.
"""

from __future__ import annotations

import collections
import copy
import datetime
import functools
import io
import json
import logging
import re
from typing import Any

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from consumer.logs import (
    JsonMessageLog,
    StructlogMessageLog,
    TickFlushed,
    make_logger,
    make_message_log,
)

SERVICE = "consumer-test"
EVENT = "message settled"
TIMESTAMP = re.compile(rb'"timestamp":"([^"]*)"')


class Sinks:
    """One structlog JSON logger and one JsonMessageLog at a threshold, over their own bytes."""

    def __init__(self, threshold: str) -> None:
        self.structlog_bytes, self.fast_bytes = io.BytesIO(), io.BytesIO()
        self.logger = make_logger(
            SERVICE,
            level=threshold,
            log_format="json",
            stream=io.TextIOWrapper(io.BytesIO()),
            lines=TickFlushed(self.structlog_bytes),
        )
        self.fast = JsonMessageLog(SERVICE, level=threshold, lines=TickFlushed(self.fast_bytes))

    def lines(self, level: int, event: str, fields: dict[str, Any]) -> tuple[bytes, bytes]:
        """(JsonMessageLog's line, structlog's line) for the same call, each given its own copy
        (either may change the dict)."""
        for sink in (self.structlog_bytes, self.fast_bytes):
            sink.seek(0)
            sink.truncate()
        self.logger.log(level, event, **copy.deepcopy(fields))
        self.fast.write(level, event, copy.deepcopy(fields))
        return self.fast_bytes.getvalue(), self.structlog_bytes.getvalue()


@functools.cache
def sinks(threshold: str = "INFO") -> Sinks:
    # Cached: each TickFlushed registers an atexit hook, and hypothesis runs hundreds of examples.
    return Sinks(threshold)


def masked(line: bytes) -> bytes:
    return TIMESTAMP.sub(b'"timestamp":"<masked>"', line)


def assert_same_line(fast: bytes, structlog_line: bytes) -> None:
    assert masked(fast) == masked(structlog_line)
    if fast:
        assert fast.endswith(b"\n")
        assert fast.count(b"\n") == 1
        # The masked value is still a UTC ISO timestamp, as structlog's TimeStamper writes it.
        stamp = TIMESTAMP.findall(fast)[-1].decode()
        assert stamp.endswith("Z")
        assert datetime.datetime.fromisoformat(stamp).utcoffset() == datetime.timedelta(0)


def written(line: bytes) -> dict[str, Any]:
    value: dict[str, Any] = orjson.loads(line)
    return value


# --- the same line ------------------------------------------------------------------------------

urls = st.builds(
    "{}://{}:{}@{}/{}".format,
    st.sampled_from(["amqp", "amqps", "postgresql", "https"]),
    st.from_regex(r"[a-z]{1,8}", fullmatch=True),
    st.from_regex(r"[A-Za-z0-9!$%^*()_+-]{1,12}", fullmatch=True),
    st.sampled_from(["host", "db:5432", "[::1]:5672", "rabbit.internal"]),
    st.sampled_from(["", "vhost", "app?sslmode=require", "x?password=hunter2"]),
)
texts_with_urls = st.builds(
    lambda before, url, after: before + url + after,
    st.text(max_size=10),
    urls,
    st.text(max_size=10),
)
leaves = (
    st.none()
    | st.booleans()
    | st.integers(-(2**63), 2**63 - 1)
    | st.floats()
    | st.text(max_size=30)
    | urls
    | texts_with_urls
)
values = st.recursive(
    leaves,
    lambda children: (
        st.lists(children, max_size=4)
        | st.lists(children, max_size=3).map(tuple)
        | st.dictionaries(st.text(max_size=10), children, max_size=4)
    ),
    max_leaves=15,
)
# Not "event" or "level": logger.log(level, event, **fields) cannot take them. Not "exc_info":
# its own case below.
field_names = st.text(max_size=16).filter(lambda name: name not in {"event", "level", "exc_info"})
field_sets = st.dictionaries(
    field_names | st.sampled_from(["service", "timestamp", "url", "error"]), values, max_size=8
)
levels = st.sampled_from([logging.DEBUG, logging.INFO, logging.WARNING, logging.ERROR, 50])
thresholds = st.sampled_from(["DEBUG", "INFO", "WARNING", "ERROR"])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(field_sets, levels, thresholds, st.text(max_size=20) | texts_with_urls)
def test_any_fields_make_the_line_structlog_makes(
    fields: dict[str, Any], level: int, threshold: str, event: str
) -> None:
    assert_same_line(*sinks(threshold).lines(level, event, fields))


def test_the_services_usual_line_is_structlogs() -> None:
    fields = {
        "event_id": "5b1f0d0e-8f8e-4c1a-9d55-1f2f4f6e9a10",
        "type": "order.created",
        "message_id": "m-1",
        "routing_key": "order.created",
        "redelivered": False,
        "attempt": 0,
        "outcome": "processed",
        "duration_ms": 1.25,
    }
    fast, structlog_line = sinks().lines(logging.INFO, EVENT, fields)
    assert_same_line(fast, structlog_line)
    assert list(written(fast)) == ["service", *fields, "event", "level", "timestamp"]


def test_a_password_in_a_url_is_scrubbed_as_structlog_scrubs_it() -> None:
    fields = {
        "publish_error": "cannot reach amqp://user:secret@host/vhost",
        "nested": {"dsn": ["postgresql://app:pw@db:5432/x?sslpassword=k", 3]},
        "pair": ("https://a:b@example.com/", None),
    }
    fast, structlog_line = sinks().lines(logging.WARNING, EVENT, fields)
    assert_same_line(fast, structlog_line)
    line = written(fast)
    assert line["publish_error"] == "cannot reach amqp://user:***@host/vhost"
    assert line["nested"] == {"dsn": ["postgresql://app:***@db:5432/x?sslpassword=***", 3]}
    assert line["pair"] == ["https://a:***@example.com/", None]
    assert b"secret" not in fast
    assert b"pw@" not in fast


def test_a_url_in_the_event_is_scrubbed_as_structlog_scrubs_it() -> None:
    fast, structlog_line = sinks().lines(logging.INFO, "connected to amqp://u:p@h/", {})
    assert_same_line(fast, structlog_line)
    assert written(fast)["event"] == "connected to amqp://u:***@h/"


def test_a_warning_line_says_warning() -> None:
    fast, structlog_line = sinks().lines(logging.WARNING, EVENT, {"reason": "expired"})
    assert_same_line(fast, structlog_line)
    assert written(fast)["level"] == "warning"


@pytest.mark.parametrize(
    ("level", "threshold"),
    [(logging.DEBUG, "INFO"), (logging.INFO, "WARNING"), (logging.WARNING, "ERROR")],
)
def test_a_line_below_the_threshold_is_not_written(level: int, threshold: str) -> None:
    fast, structlog_line = sinks(threshold).lines(level, EVENT, {"attempt": 1})
    assert (fast, structlog_line) == (b"", b"")


def test_fields_named_like_the_lines_own_keys_keep_structlogs_order_and_values() -> None:
    # structlog binds service first and sets timestamp over a field of that name in place.
    fields = {"timestamp": "a producer's", "service": "overridden", "attempt": 2}
    fast, structlog_line = sinks().lines(logging.INFO, EVENT, fields)
    assert_same_line(fast, structlog_line)
    assert list(written(fast)) == ["service", "timestamp", "attempt", "event", "level"]
    assert written(fast)["service"] == "overridden"


class _Opaque:
    def __repr__(self) -> str:
        return "<opaque amqp://user:secret@host/>"


def test_a_value_json_cannot_hold_is_its_repr_as_in_structlog() -> None:
    # Neither scrubs inside a repr: the same line, password included (see the report).
    fast, structlog_line = sinks().lines(
        logging.INFO, EVENT, {"opaque": _Opaque(), "when": datetime.datetime(2024, 1, 2)}
    )
    assert_same_line(fast, structlog_line)


def test_a_mapping_that_is_not_a_dict_is_written_as_structlog_writes_it() -> None:
    fields = {"headers": collections.ChainMap({"x-origin": "api"})}
    assert_same_line(*sinks().lines(logging.INFO, EVENT, fields))


@pytest.mark.xfail(
    strict=True,
    reason="structlog's ExceptionRenderer pops an 'exc_info' field; JsonMessageLog writes it",
)
def test_a_field_named_exc_info_is_written_as_structlog_writes_it() -> None:
    assert_same_line(*sinks().lines(logging.INFO, EVENT, {"exc_info": False}))


# --- values orjson refuses: the line is written all the same ----------------------------------

# Any producer can put these in a payload value (logged with CONSUMER_LOG_PAYLOADS).
REFUSED_BY_ORJSON = [2**64, -(2**70), "lone \ud800 surrogate", {"n": [2**100], "s": "\udfff"}]


@pytest.mark.parametrize("value", REFUSED_BY_ORJSON, ids=["2**64", "-2**70", "surrogate", "nested"])
def test_a_value_orjson_refuses_is_written_as_json_by_both_loggers(value: object) -> None:
    fast, structlog_line = sinks().lines(logging.WARNING, EVENT, {"payload": value})

    assert_same_line(fast, structlog_line)
    assert json.loads(fast)["payload"] == value


class _Unprintable:
    def __repr__(self) -> str:
        raise RuntimeError("no repr")


def test_a_value_nothing_can_write_still_leaves_a_line() -> None:
    fast, structlog_line = sinks().lines(
        logging.WARNING, EVENT, {"odd": _Unprintable(), "big": 2**70}
    )

    for line in (fast, structlog_line):
        written_line = json.loads(line)
        assert written_line["event"] == EVENT
        assert "cannot be written" in written_line["odd"]


def test_the_console_logger_writes_what_its_stream_cannot_encode_escaped() -> None:
    # Given the console form on a UTF-8 stream, and an error whose message holds a lone
    # surrogate (a handler's error quoting a payload): its traceback is printed as it is
    stream = io.TextIOWrapper(io.BytesIO(), encoding="utf-8")
    logger = make_logger(SERVICE, log_format="console", stream=stream)
    try:
        raise ValueError("bad key 'lone \ud800 surrogate'")
    except ValueError as error:
        # When it is logged
        logger.error("handler failed", exc_info=error, payload=REFUSED_BY_ORJSON)

    # Then the line is written, the surrogate escaped
    stream.flush()
    written_text = stream.buffer.getvalue().decode()
    assert "handler failed" in written_text
    assert "bad key 'lone \\ud800 surrogate'" in written_text


# --- choosing the message log -------------------------------------------------------------------


class _Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_the_json_format_gets_the_json_message_log() -> None:
    lines_out = io.BytesIO()
    lines = TickFlushed(lines_out)
    logger = make_logger(
        SERVICE, log_format="json", stream=io.TextIOWrapper(io.BytesIO()), lines=lines
    )
    message_log = make_message_log(logger, SERVICE, log_format="json", lines=lines)
    assert isinstance(message_log, JsonMessageLog)
    message_log.write(logging.INFO, EVENT, {"attempt": 0})
    assert written(lines_out.getvalue())["attempt"] == 0


def test_the_console_format_goes_through_the_structlog_logger() -> None:
    console = io.StringIO()
    logger = make_logger(SERVICE, log_format="console", stream=console)
    message_log = make_message_log(
        logger, SERVICE, log_format="console", lines=TickFlushed(io.BytesIO()), stream=console
    )
    assert isinstance(message_log, StructlogMessageLog)
    message_log.write(logging.INFO, EVENT, {"error": "amqp://user:secret@host/"})
    assert EVENT in console.getvalue()
    assert "amqp://user:***@host/" in console.getvalue()


@pytest.mark.parametrize(
    ("stream", "expected"),
    [(_Terminal(), StructlogMessageLog), (io.StringIO(), JsonMessageLog)],
    ids=["terminal", "pipe"],
)
def test_the_auto_format_follows_the_stream_as_make_logger_does(
    stream: io.StringIO, expected: type
) -> None:
    lines = TickFlushed(io.BytesIO())
    logger = make_logger(SERVICE, log_format="console", stream=stream)
    message_log = make_message_log(logger, SERVICE, log_format="auto", lines=lines, stream=stream)
    assert type(message_log) is expected
