"""Text from hostile input made safe to log and print: one line, control characters escaped, and
validation errors told without echoing the input they refused."""

from __future__ import annotations

from pydantic import ValidationError

__all__ = ["describe_validation_error", "one_line"]


def describe_validation_error(error: ValidationError, limit: int = 3) -> str:
    """A short, one-line account of what failed validation, without echoing the input."""
    parts = []
    for detail in error.errors(include_url=False, include_input=False)[:limit]:
        where = ".".join(str(part) for part in detail["loc"]) or "body"
        parts.append(f"{where[:100]}: {detail['msg']}")
    more = error.error_count() - limit
    if more > 0:
        parts.append(f"and {more} more")
    return one_line("; ".join(parts))


# Control characters (C0, DEL, C1: a terminal obeys ESC and CSI sequences), everything
# str.splitlines() breaks at, and the bidirectional overrides that make text read other than it is.
_CONTROL = {
    code: f"\\u{code:04x}"
    for code in (
        *range(32),
        *range(0x7F, 0xA0),
        0x2028,
        0x2029,
        0x200E,
        0x200F,
        *range(0x202A, 0x202F),
        *range(0x2066, 0x206A),
    )
}


def one_line(text: str, limit: int = 500) -> str:
    """``text`` on one line, control characters escaped (they come from hostile input)."""
    flat = text.translate(_CONTROL)
    return flat if len(flat) <= limit else flat[: limit - 1] + "…"
