"""The settings a harness runs the service with: the environment's (``CONSUMER_*``), as in
production, with the names made the test's own."""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from typing import Any

from pydantic import SecretStr

from consumer.config.settings import Settings

__all__ = ["BROKER_VARIABLE", "broker_requested", "harness_settings"]

BROKER_VARIABLE = "CONSUMER_TEST_BROKER"
"""Set to ``1`` (or ``true``, ``yes``), the harness runs against the real broker."""


def broker_requested() -> bool:
    """Whether ``CONSUMER_TEST_BROKER`` asks for the real broker."""
    return os.environ.get(BROKER_VARIABLE, "").strip().lower() in ("1", "true", "yes", "on")


def harness_settings(handlers: Sequence[str], database_url: str, **overrides: Any) -> Settings:
    """The environment's settings with ``handlers``, the database at ``database_url`` and a name
    of the test's own (``CONSUMER_NAME``; its ingress exchange ``<name>.events``), so that its
    queues and exchanges never meet a running service's. ``overrides`` are settings by field
    name (``retry_delays=("1s", "5s")``)."""
    name = overrides.pop("name", None) or f"ctest-{uuid.uuid4().hex[:10]}"
    values: dict[str, Any] = {
        "handlers": tuple(handlers),
        "database_url": SecretStr(database_url),
        "name": name,
        "exchange": f"{name}.events",
    }
    values.update(overrides)
    return Settings(**values)
