"""What several commands share: argument types, and a database connection or one line why not."""

from __future__ import annotations

import argparse
from typing import Any

import asyncpg

from consumer.config.settings import Settings
from consumer.config.startup import EXIT_CONFIG, fail
from consumer.db.database import describe_database_error
from consumer.errors import ConfigError
from consumer.service.components import database_config

__all__ = ["connect_or_fail", "positive_int"]


def positive_int(value: str) -> int:
    """An argument that is a whole number above 0 (``--limit``, ``--scan``)."""
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number < 1:
        raise argparse.ArgumentTypeError(f"{value!r} is not a whole number above 0")
    return number


async def connect_or_fail(settings: Settings) -> Any:
    """One database connection for a command, or its end with one line saying why not."""
    database = database_config(settings)
    try:
        return await database.connector()(database.dsn)
    except ConfigError as error:
        fail(str(error), EXIT_CONFIG)
    except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError) as error:
        fail(f"cannot connect to {settings.safe_database_url}: {describe_database_error(error)}")
