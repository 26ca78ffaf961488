"""Structured logs: JSON lines on stdout, or a readable console form when stdout is a terminal.

The logger is built in ``main()`` and passed in; nothing here is configured at import. Every string
that goes out passes :func:`consumer.redact.scrub`, so a password in a URL never reaches a log.

JSON lines written on the event loop go out once per turn of the loop, not once per line (a write
and a flush per settled message cost several percent of the service's CPU): a process killed
outright loses at most the lines of the turn it died in; exits that skip the interpreter's clean-up
call :meth:`TickFlushed.write_out` first. Outside a running loop every line is written and flushed
at once.
"""

from __future__ import annotations

import asyncio
import atexit
import json
import logging
import sys
import time
from collections.abc import Callable, Mapping, MutableMapping
from typing import IO, Any, BinaryIO, Protocol, TextIO, cast

import orjson
import structlog
from structlog.typing import EventDict, FilteringBoundLogger, Processor, WrappedLogger

from consumer.redact import scrub

__all__ = [
    "JsonMessageLog",
    "Logger",
    "MessageLog",
    "StructlogMessageLog",
    "TickFlushed",
    "json_line",
    "make_logger",
    "make_message_log",
    "route_library_logs",
    "scrub_secrets",
]

Logger = FilteringBoundLogger

_LEVELS = {"DEBUG": logging.DEBUG, "INFO": logging.INFO, "WARNING": logging.WARNING}
_LEVELS["ERROR"] = logging.ERROR


def _scrub_value(value: Any) -> Any:
    if isinstance(value, str):
        return scrub(value) if "://" in value else value
    if isinstance(value, Mapping):
        return {key: _scrub_value(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_scrub_value(item) for item in value]
    return value


def scrub_secrets(_: WrappedLogger, __: str, event_dict: EventDict) -> EventDict:
    """Replace the password of every URL in every value with ``***``."""
    for key, value in event_dict.items():
        # One line per message passes here: skip the values that cannot hold a URL, cheaply.
        if type(value) not in _PLAIN:
            event_dict[key] = _scrub_value(value)
    return event_dict


_PLAIN = frozenset({int, float, bool, type(None)})


def json_line(line: Mapping[str, Any], default: Callable[[Any], Any] | None = None) -> bytes:
    """``line`` as one line of JSON, whatever its values: never an exception.

    orjson writes nearly every line. What it refuses (an integer past 64 bits, a string holding a
    lone surrogate, both of which any producer can put in a payload) the standard library's json
    writes instead (the surrogate as its ``\\u`` escape); what neither can, each value as its
    ``ascii()`` text. A log line that raised would end the worker that wrote it."""
    try:
        return orjson.dumps(line, default=default)
    except TypeError:  # orjson.JSONEncodeError is one
        pass
    try:
        text = json.dumps(line, default=default, ensure_ascii=False, separators=(",", ":"))
        return text.encode("utf-8", "backslashreplace")
    except Exception:  # anything: the line below cannot fail
        return orjson.dumps({_printable(key): _printable(value) for key, value in line.items()})


def _printable(value: object) -> str:
    try:
        return value if type(value) is str and value.isascii() else ascii(value)[:10_000]
    except Exception:  # an int past str()'s digit limit, a broken __repr__
        return f"<{type(value).__name__} that cannot be written>"


def _encodable(encoding: str) -> Processor:
    """The console line as the stream can write it: ``print`` raises on a character the
    stream's encoding has not (a lone surrogate even in UTF-8); those are escaped."""

    def encodable(_: WrappedLogger, __: str, line: Any) -> Any:
        if isinstance(line, str) and not line.isascii():
            return line.encode(encoding, "backslashreplace").decode(encoding)
        return line

    return encodable


def _processors(console: bool, encoding: str = "utf-8") -> list[Processor]:
    shared: list[Processor] = [
        structlog.processors.add_log_level,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
    ]
    if console:
        return [
            *shared,
            structlog.processors.format_exc_info,
            scrub_secrets,
            structlog.dev.ConsoleRenderer(colors=False),
            _encodable(encoding),
        ]
    return [
        *shared,
        # Never the locals: a frame may hold a password that is not in a URL.
        structlog.processors.ExceptionRenderer(
            structlog.tracebacks.ExceptionDictTransformer(show_locals=False)
        ),
        scrub_secrets,
        structlog.processors.JSONRenderer(serializer=json_line),
    ]


def _wants_console(log_format: str, stream: TextIO) -> bool:
    if log_format == "auto":
        return stream.isatty()
    return log_format == "console"


def make_logger(
    service: str,
    *,
    level: str = "INFO",
    log_format: str = "auto",
    stream: TextIO | None = None,
    lines: TickFlushed | None = None,
) -> Logger:
    """``service``'s logger, writing to ``stream`` (stdout by default) at ``level``, in
    ``log_format`` (``json``, ``console``, or ``auto``: console on a terminal).

    JSON lines go through ``lines`` (made over ``stream``'s binary buffer if not given): pass one
    to be able to write out what it holds before an immediate exit.
    """
    out = stream if stream is not None else sys.stdout
    console = _wants_console(log_format, out)
    # JSON lines are rendered to bytes (orjson) and written to the binary stream underneath.
    sink: Any = (
        structlog.PrintLogger(out)
        if console
        else structlog.BytesLogger(cast(BinaryIO, lines or TickFlushed(out.buffer)))
    )
    logger: Logger = structlog.wrap_logger(
        sink,
        processors=_processors(console, getattr(out, "encoding", None) or "utf-8"),
        wrapper_class=structlog.make_filtering_bound_logger(_LEVELS[level]),
        cache_logger_on_first_use=False,
    )
    return logger.bind(service=service)


class MessageLog(Protocol):
    """Where the line of each settled delivery goes (:mod:`consumer.observe.report`)."""

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        """Log ``event`` with ``fields`` (the dict is the line's: it may be changed)."""


class StructlogMessageLog:
    """The per-delivery line through the service's structlog logger: the console form."""

    def __init__(self, logger: Logger) -> None:
        self._logger = logger

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        self._logger.log(level, event, **fields)


_LEVEL_NAMES = {number: name.lower() for name, number in _LEVELS.items()}


class JsonMessageLog:
    """The per-delivery line rendered straight to the JSON the structlog chain writes (same
    keys, same order, the same scrubbing of URLs), without that chain.

    One line per settled delivery passes here: through structlog's bound logger and its five
    processors a line costs about 21 µs, here about 6 (measured on the service's line). Every
    other line, rarer, keeps going through structlog.
    """

    def __init__(self, service: str, *, level: str, lines: TickFlushed) -> None:
        self._service = service
        self._threshold = _LEVELS[level]
        self._lines = lines
        self._second = -1
        self._prefix = ""

    def _timestamp(self) -> str:
        """Now as structlog's ``TimeStamper(fmt="iso", utc=True)`` writes it (always with its
        microseconds): the date and time of day formatted once a second, as
        ``datetime.now(UTC).isoformat()`` took 4 µs of the line's 9."""
        now = time.time()
        second = int(now)
        if second != self._second:
            self._second = second
            self._prefix = time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(second))
        return f"{self._prefix}.{int((now - second) * 1_000_000):06d}Z"

    def write(self, level: int, event: str, fields: dict[str, Any]) -> None:
        if level < self._threshold:
            return
        line = {
            "service": self._service,
            **fields,
            "event": event,
            "level": _LEVEL_NAMES.get(level) or logging.getLevelName(level).lower(),
            "timestamp": self._timestamp(),
        }
        rendered = json_line(line, _as_json)
        if b"://" in rendered:
            # A value holds a URL (JSON writes "://" as it is): scrub its password as the
            # structlog chain does, value by value. Every other line skips the walk.
            rendered = json_line(scrub_secrets(None, event, line), _as_json)
        self._lines.write(rendered + b"\n")


def _as_json(value: Any) -> Any:
    """What orjson cannot write itself, as the structlog chain writes it: a mapping as an
    object (its scrubbing made it a dict there), anything else as its repr."""
    if isinstance(value, Mapping):
        return dict(value)
    return repr(value)


def make_message_log(
    logger: Logger,
    service: str,
    *,
    level: str = "INFO",
    log_format: str = "auto",
    lines: TickFlushed,
    stream: TextIO | None = None,
) -> MessageLog:
    """The log of the line per settled delivery that goes with ``logger`` (made by
    :func:`make_logger` with the same arguments): JSON straight into ``lines``, or the console
    form through ``logger``."""
    if _wants_console(log_format, stream if stream is not None else sys.stdout):
        return StructlogMessageLog(logger)
    return JsonMessageLog(service, level=level, lines=lines)


class TickFlushed:
    """A binary stream for log lines, written out once per turn of the event loop.

    Lines written on the loop's thread are collected and go out together, in order, at the end
    of the turn (or sooner past 64 KiB), and at the latest when the process exits. Lines from a
    thread without a running loop (the watchdog, the CLI) are written and flushed at once.
    """

    def __init__(self, stream: IO[bytes], *, limit: int = 64 * 1024) -> None:
        self._stream = stream
        self._limit = limit
        self._pending: list[bytes] = []
        self._size = 0
        self._scheduled_on: asyncio.AbstractEventLoop | None = None
        # A loop that ends before its last turn's write-out runs leaves lines here.
        atexit.register(self.write_out)

    def write(self, data: bytes) -> int:
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:
            written = self._stream.write(data)
            self._stream.flush()
            return written
        self._pending.append(data)
        self._size += len(data)
        if self._size >= self._limit:
            self.write_out()
        # Compared by loop: a write-out left scheduled on a loop that has closed never runs.
        elif self._scheduled_on is not loop:
            self._scheduled_on = loop
            loop.call_soon(self.write_out)
        return len(data)

    def flush(self) -> None:
        """Nothing to do: :meth:`write` flushes, or has the end of the turn do it."""

    def write_out(self) -> None:
        """Write and flush what the loop's thread has collected."""
        self._scheduled_on = None
        if self._pending:
            data = b"".join(self._pending)
            self._pending.clear()
            self._size = 0
            self._stream.write(data)
        self._stream.flush()


class _LibraryHandler(logging.Handler):
    """Sends the libraries' stdlib log records (aio-pika, asyncpg) through the service's logger."""

    def __init__(self, logger: Logger) -> None:
        super().__init__()
        self._logger = logger

    def emit(self, record: logging.LogRecord) -> None:
        try:
            fields: MutableMapping[str, Any] = {"logger": record.name}
            if record.exc_info and record.exc_info[1] is not None:
                fields["error"] = repr(record.exc_info[1])
            self._logger.log(record.levelno, record.getMessage(), **fields)
        except Exception:
            self.handleError(record)


def route_library_logs(logger: Logger, level: str = "WARNING") -> None:
    """Send warnings and errors from the libraries through ``logger`` as JSON (called in main)."""
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, _LibraryHandler):
            root.removeHandler(handler)
    root.addHandler(_LibraryHandler(logger))
    root.setLevel(_LEVELS.get(level, logging.WARNING))
