"""What every command does first: read the settings and load the handlers, or stop with one line."""

from __future__ import annotations

import os
import sys
from typing import NoReturn

from pydantic import ValidationError

from consumer.config.queue_table import QueueTable, read_queue_table
from consumer.config.setting_errors import describe_settings_error, unknown_variables
from consumer.config.settings import Settings
from consumer.errors import ConfigError
from consumer.registry import HandlerRegistry

__all__ = [
    "EXIT_CONFIG",
    "EXIT_FAILURE",
    "fail",
    "load_handlers",
    "load_queue_table",
    "load_settings",
]

EXIT_CONFIG = 2
EXIT_FAILURE = 1


def fail(message: str, code: int = EXIT_FAILURE) -> NoReturn:
    """Print one line to stderr and exit: the whole story a person at 3 a.m. needs."""
    print(f"error: {message}", file=sys.stderr, flush=True)
    raise SystemExit(code)


def load_settings() -> Settings:
    """The settings from the environment; a bad value, or a ``CONSUMER_*`` variable that is no
    setting, exits 2 with one line naming it."""
    problems = unknown_variables(os.environ)
    if problems:
        fail("; ".join(problems), EXIT_CONFIG)
    try:
        return Settings()
    except ValidationError as error:
        fail(describe_settings_error(error), EXIT_CONFIG)


def load_handlers(settings: Settings) -> HandlerRegistry:
    """The handlers ``CONSUMER_HANDLERS`` names; an unusable module exits 2 with one line."""
    try:
        return HandlerRegistry.from_modules(settings.handlers)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)


def load_queue_table(settings: Settings, registry: HandlerRegistry) -> QueueTable:
    """The queues the service consumes: the table ``CONSUMER_QUEUES_FILE`` names, checked
    against the handlers, or (unset) the one queue of every handler's type, under today's names.
    An unusable table exits 2 with one line naming the file, the queue and the key."""
    if settings.queues_file is None:
        return QueueTable.default(settings, registry)
    try:
        table = read_queue_table(settings.queues_file, settings)
        table.check_handlers(registry)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    return table
