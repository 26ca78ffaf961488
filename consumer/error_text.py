"""Exceptions put into words for logs, headers, metrics and spans: a class name of low
cardinality, and a message that is there even when a handler's exception cannot say it."""

from __future__ import annotations

__all__ = ["error_name", "message_of"]

# The service's own errors are named bare (``PermanentError``), as they were when these helpers
# lived in consumer.errors: retry and dead-letter headers, log lines and spans carry the names.
_BARE_MODULES = ("builtins", "consumer.errors")


def message_of(error: BaseException) -> str:
    """``str(error)``, or what says it could not be made: a handler's exception class whose
    ``__str__`` raises must fail its own event, not the code that judges, settles or logs it."""
    try:
        return str(error)
    except Exception as failure:
        return f"<the message of {error_name(error)} raised {error_name(failure)}>"


def error_name(error: BaseException) -> str:
    """A stable, low-cardinality name for an exception's class."""
    cls = type(error)
    module = cls.__module__
    if module in _BARE_MODULES:
        return cls.__qualname__
    return f"{module}.{cls.__qualname__}"
