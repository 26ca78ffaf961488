"""The service's settings: one typed object, read from ``CONSUMER_*`` environment variables once in
``main()`` and passed to whatever needs it.

Durations are written with a unit (``500ms``, ``5s``, ``2m``, ``1h``; a bare number is seconds).
Choices such as the log level are case-insensitive. A bad value raises ``pydantic.ValidationError``;
:func:`describe_settings_error` turns it into the one line start-up prints.
"""

from __future__ import annotations

import re
from datetime import timedelta
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BeforeValidator,
    Field,
    SecretStr,
    ValidationError,
    ValidationInfo,
    field_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from consumer.durations import format_duration, parse_duration
from consumer.redact import redact_url

ENV_PREFIX = "CONSUMER_"

DEFAULT_HANDLER_MODULES = (
    "consumer.handlers.inventory",
    "consumer.handlers.notifications",
)


def _upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


def _lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def _positive_duration(value: object) -> timedelta:
    duration = parse_duration(value)
    if duration <= timedelta(0):
        raise ValueError("must be longer than zero")
    return duration


Duration = Annotated[timedelta, BeforeValidator(_positive_duration)]
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], BeforeValidator(_upper)]
LogFormat = Annotated[Literal["auto", "json", "console"], BeforeValidator(_lower)]

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
_HANDLER_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def _split_list(value: object) -> object:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


class Settings(BaseSettings):
    """Everything the service can be told. Field ``x`` is read from ``CONSUMER_X``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        case_sensitive=False,
        frozen=True,
        extra="ignore",
    )

    amqp_url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/")
    database_url: SecretStr = SecretStr("postgresql://postgres@127.0.0.1:5432/consumer")
    name: str = "consumer"
    exchange: str = "events"
    prefetch: int = Field(default=50, ge=1, le=65535)
    db_pool_size: int = Field(default=10, ge=1, le=1000)
    batch_size: int = Field(default=1, ge=1, le=1000)
    batch_wait: Annotated[timedelta, BeforeValidator(parse_duration)] = timedelta(0)
    batch_lock_timeout: Duration = timedelta(milliseconds=100)
    http_host: str = "127.0.0.1"
    http_port: int = Field(default=8080, ge=1, le=65535)
    retry_delays: Annotated[tuple[Duration, ...], NoDecode, BeforeValidator(_split_list)] = (
        timedelta(seconds=1),
        timedelta(seconds=5),
        timedelta(seconds=30),
        timedelta(minutes=2),
        timedelta(minutes=10),
    )
    retry_jitter: float = Field(default=0.0, ge=0.0, le=1.0)
    delivery_limit: int = Field(default=5, ge=1, le=1000)
    handlers: Annotated[tuple[str, ...], NoDecode, BeforeValidator(_split_list)] = (
        DEFAULT_HANDLER_MODULES
    )
    handler_timeout: Duration = timedelta(seconds=15)
    hard_timeout: Duration = timedelta(seconds=20)
    shutdown_grace: Duration = timedelta(seconds=30)
    publish_timeout: Duration = timedelta(seconds=10)
    reconnect_max_delay: Duration = timedelta(seconds=30)
    max_body_bytes: int = Field(default=1024 * 1024, ge=64, le=128 * 1024 * 1024)
    log_level: LogLevel = "INFO"
    log_format: LogFormat = "auto"
    log_payloads: bool = False

    @field_validator("amqp_url")
    @classmethod
    def _check_amqp_url(cls, value: SecretStr) -> SecretStr:
        scheme = urlsplit(value.get_secret_value()).scheme
        if scheme not in ("amqp", "amqps"):
            raise ValueError("must be an amqp:// or amqps:// URL")
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: SecretStr) -> SecretStr:
        scheme = urlsplit(value.get_secret_value()).scheme
        if scheme not in ("postgres", "postgresql"):
            raise ValueError("must be a postgresql:// URL")
        return value

    @field_validator("name", "exchange")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not _NAME.match(value):
            raise ValueError(
                f"{value!r} is not a usable name (letters, digits, '_', '.', '-'; at most 100)"
            )
        return value

    @field_validator("retry_delays")
    @classmethod
    def _check_ladder(cls, value: tuple[timedelta, ...]) -> tuple[timedelta, ...]:
        names = [format_duration(delay) for delay in value]
        if len(set(names)) != len(names):
            raise ValueError(f"the same delay appears twice in {','.join(names)}")
        if any(delay.total_seconds() * 1000 % 1 for delay in value):
            raise ValueError("delays are whole milliseconds")
        return value

    @field_validator("handlers")
    @classmethod
    def _check_handlers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("name at least one handler module")
        for module in value:
            if not _HANDLER_MODULE.match(module):
                raise ValueError(f"{module!r} is not a module name")
        return value

    @field_validator("hard_timeout")
    @classmethod
    def _check_hard_timeout(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        soft = info.data.get("handler_timeout")
        if soft is not None and value <= soft:
            raise ValueError(
                f"must be longer than CONSUMER_HANDLER_TIMEOUT ({format_duration(soft)})"
            )
        return value

    @property
    def safe_amqp_url(self) -> str:
        return redact_url(self.amqp_url.get_secret_value())

    @property
    def safe_database_url(self) -> str:
        return redact_url(self.database_url.get_secret_value())

    def describe(self) -> dict[str, Any]:
        """The settings as plain values, fit to log: URLs keep no password."""
        values = self.model_dump()
        values["amqp_url"] = self.safe_amqp_url
        values["database_url"] = self.safe_database_url
        for key, value in values.items():
            if isinstance(value, timedelta):
                values[key] = format_duration(value)
            elif isinstance(value, tuple) and value and isinstance(value[0], timedelta):
                values[key] = ",".join(format_duration(item) for item in value)
        return values


def describe_settings_error(error: ValidationError) -> str:
    """One line naming each bad setting and what is wrong with it; never echoes a URL."""
    problems = []
    for detail in error.errors(include_url=False):
        field = str(detail["loc"][0]) if detail["loc"] else ""
        env_name = f"{ENV_PREFIX}{field.upper()}"
        message = detail["msg"].removeprefix("Value error, ")
        if field not in ("amqp_url", "database_url") and detail["type"] != "missing":
            given = detail.get("input")
            if isinstance(given, str | int | float):
                message = f"{message} (got {given!r})"
        problems.append(f"{env_name}: {message}")
    return "invalid setting " + "; ".join(problems)
