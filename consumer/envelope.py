"""The event envelope producers publish, and the parser that turns a message body into one.

The parser never raises anything but :class:`Poison`: for any bytes it returns an envelope or says
why the message can never be processed.
"""

from __future__ import annotations

import enum
from datetime import datetime
from typing import Any, Generic, TypeVar
from uuid import UUID

from pydantic import AwareDatetime, BaseModel, ConfigDict, Field, ValidationError

PayloadT = TypeVar("PayloadT")

EVENT_TYPE_PATTERN = r"^[A-Za-z0-9_-]+(\.[A-Za-z0-9_-]+)*$"


class Envelope(BaseModel, Generic[PayloadT]):
    """One event: what producers publish as the JSON body of a message.

    Handlers receive it with ``payload`` already validated by their payload model.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    event_id: UUID
    type: str = Field(min_length=1, max_length=255, pattern=EVENT_TYPE_PATTERN)
    occurred_at: AwareDatetime
    payload: PayloadT
    correlation_id: str | None = Field(default=None, max_length=255)


RawEnvelope = Envelope[dict[str, Any]]


class PoisonReason(enum.StrEnum):
    """Why a message can never be processed, whatever is retried."""

    BODY_TOO_LARGE = "body_too_large"
    WRONG_CONTENT_TYPE = "wrong_content_type"
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    INVALID_ENVELOPE = "invalid_envelope"
    UNKNOWN_TYPE = "unknown_type"
    INVALID_PAYLOAD = "invalid_payload"


class Poison(Exception):
    """A message that can never be processed, with the reason and a short detail for people."""

    def __init__(self, reason: PoisonReason, detail: str) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail


_JSON_CONTENT_TYPES = frozenset({"application/json", "text/json"})
_IDENTITY_ENCODINGS = frozenset({"", "identity", "utf-8", "utf8"})


def check_content_type(content_type: str | None, content_encoding: str | None) -> None:
    """Accept an absent or JSON content type and no content encoding; raise :class:`Poison` else."""
    if content_type:
        media_type, _, params = content_type.partition(";")
        if media_type.strip().lower() not in _JSON_CONTENT_TYPES:
            raise Poison(PoisonReason.WRONG_CONTENT_TYPE, f"content type {content_type!r}")
        charset = params.strip().lower().removeprefix("charset=").strip('"')
        if params.strip() and charset not in ("utf-8", "utf8"):
            raise Poison(PoisonReason.WRONG_CONTENT_TYPE, f"content type {content_type!r}")
    if content_encoding and content_encoding.strip().lower() not in _IDENTITY_ENCODINGS:
        raise Poison(PoisonReason.WRONG_CONTENT_TYPE, f"content encoding {content_encoding!r}")


def parse_envelope(body: bytes, *, max_bytes: int) -> RawEnvelope:
    """Parse a message body straight from bytes into an envelope whose payload is still a dict."""
    if len(body) > max_bytes:
        raise Poison(PoisonReason.BODY_TOO_LARGE, f"{len(body)} bytes, the limit is {max_bytes}")
    try:
        return RawEnvelope.model_validate_json(body)
    except ValidationError as error:
        raise _poison_from(error, body) from None


def _poison_from(error: ValidationError, body: bytes) -> Poison:
    details = error.errors(include_url=False, include_input=False)
    if any(detail["type"] == "json_invalid" for detail in details):
        try:
            body.decode("utf-8")
        except UnicodeDecodeError as exc:
            return Poison(PoisonReason.NOT_UTF8, f"invalid UTF-8 at byte {exc.start}")
        return Poison(PoisonReason.NOT_JSON, details[0]["msg"])
    if any(detail["type"] == "model_type" and not detail["loc"] for detail in details):
        return Poison(PoisonReason.INVALID_ENVELOPE, "the body is not a JSON object")
    return Poison(PoisonReason.INVALID_ENVELOPE, describe_validation_error(error))


def describe_validation_error(error: ValidationError, limit: int = 3) -> str:
    """A short, one-line account of what failed validation, without echoing the input."""
    parts = []
    for detail in error.errors(include_url=False, include_input=False)[:limit]:
        where = ".".join(str(part) for part in detail["loc"]) or "body"
        parts.append(f"{where}: {detail['msg']}")
    more = error.error_count() - limit
    if more > 0:
        parts.append(f"and {more} more")
    return "; ".join(parts)


def event_age_seconds(occurred_at: datetime, now: datetime) -> float:
    """Seconds from when the event occurred to ``now`` (both timezone-aware)."""
    return (now - occurred_at).total_seconds()
