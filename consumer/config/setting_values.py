"""How a setting's text becomes its value: the parsers, types and checks that
:class:`consumer.config.settings.Settings` declares its fields with.

Each raises ``ValueError`` with a message that completes "CONSUMER_X ...", so that
:func:`consumer.config.setting_errors.describe_settings_error` can name the setting in one line.
"""

from __future__ import annotations

import re
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Literal
from urllib.parse import parse_qs, urlsplit

from pydantic import BeforeValidator

from consumer.durations import parse_duration
from consumer.redact import redact_url

__all__ = [
    "AMQP_TLS_QUERY",
    "ENV_PREFIX",
    "HANDLER_MODULE",
    "NAME",
    "SECRET_FROM_FILE",
    "VERIFYING_SSLMODES",
    "WRITABLE_SESSIONS",
    "Duration",
    "LogFormat",
    "LogLevel",
    "SslMode",
    "check_one_amqp_url",
    "env_name",
    "module_name",
    "positive_duration",
    "read_secret_file",
    "readable_file",
    "split_ladder",
    "split_list",
    "split_urls",
]

ENV_PREFIX = "CONSUMER_"


def upper(value: object) -> object:
    return value.upper() if isinstance(value, str) else value


def lower(value: object) -> object:
    return value.lower() if isinstance(value, str) else value


def positive_duration(value: object) -> timedelta:
    duration = parse_duration(value)
    if duration <= timedelta(0):
        raise ValueError("must be longer than zero")
    return duration


Duration = Annotated[timedelta, BeforeValidator(positive_duration)]
LogLevel = Annotated[Literal["DEBUG", "INFO", "WARNING", "ERROR"], BeforeValidator(upper)]
LogFormat = Annotated[Literal["auto", "json", "console"], BeforeValidator(lower)]
SslMode = Annotated[
    Literal["disable", "allow", "prefer", "require", "verify-ca", "verify-full"],
    BeforeValidator(lower),
]

# libpq's modes that check the server's certificate (require does once a root certificate is given).
VERIFYING_SSLMODES = frozenset({"require", "verify-ca", "verify-full"})
# aiormq reads these from an amqps:// URL, but only when it is given no SSL context: the service
# always gives one, so they would be ignored. Refuse them rather than ignore them.
AMQP_TLS_QUERY = frozenset({"cafile", "capath", "cadata", "certfile", "keyfile", "no_verify_ssl"})
# A URL secret may come from a file instead (Docker and Kubernetes secrets): CONSUMER_X_FILE.
SECRET_FROM_FILE = ("amqp_url", "database_url")

WRITABLE_SESSIONS = ("read-write", "primary")
"""The ``target_session_attrs`` of a several-host ``CONSUMER_DATABASE_URL``: the primary only."""

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,99}$")
HANDLER_MODULE = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*$")


def split_list(value: object) -> object:
    if isinstance(value, str):
        return tuple(part.strip() for part in value.split(",") if part.strip())
    return value


def split_ladder(value: object) -> object:
    # An empty CONSUMER_RETRY_DELAYS= is more likely a template left unfilled than a wish for no
    # retries at all: that has to be said in so many words.
    if isinstance(value, str):
        if value.strip().lower() == "none":
            return ()
        if not value.strip():
            raise ValueError("is empty: list the delays (1s,5s,30s), or say none for no retries")
    return split_list(value)


def module_name(value: str) -> str:
    if not HANDLER_MODULE.match(value):
        raise ValueError("is not a module name")
    return value


def env_name(field: str) -> str:
    return f"{ENV_PREFIX}{field.upper()}"


def read_secret_file(field: str, path: object) -> str:
    """The content of ``CONSUMER_<FIELD>_FILE`` without its trailing newline."""
    name = env_name(f"{field}_file")
    try:
        text = Path(str(path)).read_text(encoding="utf-8")
    except OSError as error:
        raise ValueError(f"{name}: cannot read {path}: {error.strerror or error}") from None
    except UnicodeDecodeError:
        raise ValueError(f"{name}: {path} is not UTF-8 text") from None
    value = text.rstrip("\r\n")
    if not value:
        raise ValueError(f"{name}: {path} is empty")
    return value


def readable_file(value: Path | None) -> Path | None:
    if value is None:
        return None
    try:
        with value.open("rb") as file:
            file.read(1)
    except OSError as error:
        raise ValueError(f"cannot read {value}: {error.strerror or error}") from None
    return value


def split_urls(urls: str) -> list[str]:
    """``CONSUMER_AMQP_URL`` may list a cluster's nodes, comma-separated."""
    return [url.strip() for url in urls.split(",") if url.strip()]


def check_one_amqp_url(url: str, *, several: bool) -> None:
    parts = urlsplit(url)
    where = f" ({redact_url(url)})" if several else ""
    if parts.scheme not in ("amqp", "amqps"):
        raise ValueError(f"must be an amqp:// or amqps:// URL{where}")
    try:
        parts.port  # noqa: B018 - raises on a port that is not a number in range
    except ValueError:
        raise ValueError(f"has a port that is not a number from 0 to 65535{where}") from None
    if not parts.hostname:
        raise ValueError(f"names no host{where}")
    refused = sorted(AMQP_TLS_QUERY & parse_qs(parts.query).keys())
    if refused:
        raise ValueError(
            f"TLS options in the URL ({', '.join(refused)}) are not used: set "
            "CONSUMER_AMQP_CA_FILE, CONSUMER_AMQP_CERT_FILE, CONSUMER_AMQP_KEY_FILE or "
            "CONSUMER_AMQP_VERIFY_HOSTNAME instead"
        )
