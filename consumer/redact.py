"""Keeping passwords out of everything the service prints."""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

__all__ = ["redact_url", "scrub"]

# The password runs to the last "@" before the host's end: a password with an unescaped "@"
# ("u:p@ss@host") is still hidden whole, as urlsplit reads it.
_CREDENTIALS_IN_URL = re.compile(r"(?P<prefix>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^\s/?#]*@")

# Query parameters that carry a secret: libpq's and asyncpg's password and sslpassword, and any
# other name that says so.
_SECRET_PARAMETER = re.compile(r"pass|secret|token", re.IGNORECASE)
_SECRET_IN_QUERY = re.compile(
    r"(?P<name>[?&;][^=&#\s]*(?:pass|secret|token)[^=&#\s]*=)[^&#\s]*", re.IGNORECASE
)


def redact_url(url: str) -> str:
    """The URL with its password, and any password-like query parameter, replaced by ``***``."""
    try:
        parts = urlsplit(url)
        if parts.password is not None:
            host = parts.hostname or ""
            if ":" in host:
                host = f"[{host}]"
            netloc = f"{parts.username or ''}:***@{host}"
            if parts.port is not None:
                netloc += f":{parts.port}"
            parts = parts._replace(netloc=netloc)
        if parts.query:
            query = [
                (name, "***" if _SECRET_PARAMETER.search(name) else value)
                for name, value in parse_qsl(parts.query, keep_blank_values=True)
            ]
            parts = parts._replace(query=urlencode(query, safe="*,/:"))
        return urlunsplit(parts)
    except ValueError:
        return "<unparseable URL>"


def scrub(text: str) -> str:
    """``text`` with every ``scheme://user:password@`` password and every password-like query
    parameter value in it replaced by ``***``."""
    return _SECRET_IN_QUERY.sub(r"\g<name>***", _CREDENTIALS_IN_URL.sub(r"\g<prefix>***@", text))
