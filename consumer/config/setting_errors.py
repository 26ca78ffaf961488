"""Start-up's words for bad settings: one line naming each bad setting, and the ``CONSUMER_*``
variables that are no setting at all (a misspelling would otherwise be ignored without a word).
"""

from __future__ import annotations

import difflib
from collections.abc import Callable, Mapping

from pydantic import ValidationError

from consumer.config.setting_values import ENV_PREFIX, env_name
from consumer.config.settings import Settings

__all__ = ["describe_settings_error", "settings_problems", "unknown_variables"]


def describe_settings_error(error: ValidationError) -> str:
    """One line naming each bad setting and what is wrong with it, with the bad value once (the
    messages of the checks above never repeat it); never echoes a URL."""
    return "invalid setting " + "; ".join(settings_problems(error, env_name))


def settings_problems(error: ValidationError, name: Callable[[str], str]) -> list[str]:
    """One ``<name>: <what is wrong> (got <value>)`` per bad setting, each named by ``name`` (the
    environment variable, or a queue table's key)."""
    problems = []
    for detail in error.errors(include_url=False):
        field = str(detail["loc"][0]) if detail["loc"] else ""
        message = detail["msg"].removeprefix("Value error, ")
        if not field:
            # From a check across settings: the message names them itself.
            problems.append(message)
            continue
        if (
            field not in ("amqp_url", "database_url")
            and detail["type"] != "missing"
            and not message.startswith("is empty")
        ):
            given = detail.get("input")
            if isinstance(given, str | int | float):
                message = f"{message} (got {given!r})"
        problems.append(f"{name(field)}: {message}")
    return problems


# The test suite's own variables (tests/conftest.py) share the prefix; they are not settings.
_NOT_SETTINGS_PREFIX = f"{ENV_PREFIX}TEST_"


def unknown_variables(environ: Mapping[str, str]) -> list[str]:
    """One message per ``CONSUMER_*`` variable that is no setting, naming the nearest that is.

    Only names are shown, never values: a misspelt URL variable may hold a password.
    """
    fields = sorted(field.upper() for field in Settings.model_fields)
    problems = []
    for name in sorted(environ):
        upper = name.upper()  # the settings are read case-insensitively
        if not upper.startswith(ENV_PREFIX) or upper.startswith(_NOT_SETTINGS_PREFIX):
            continue
        field = upper.removeprefix(ENV_PREFIX)
        if field in fields:
            continue
        # Compared without the prefix every name shares, which would make anything look close.
        nearest = difflib.get_close_matches(field, fields, n=1, cutoff=0.6)
        hint = (
            f"did you mean {ENV_PREFIX}{nearest[0]}?"
            if nearest
            else "docs/operations/settings.md lists them"
        )
        problems.append(f"{name} is not a setting ({hint})")
    return problems
