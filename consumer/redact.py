"""Keeping passwords out of everything the service prints."""

from __future__ import annotations

import re
from urllib.parse import urlsplit, urlunsplit

# The password runs to the last "@" before the host's end: a password with an unescaped "@"
# ("u:p@ss@host") is still hidden whole, as urlsplit reads it.
_CREDENTIALS_IN_URL = re.compile(r"(?P<prefix>[A-Za-z][A-Za-z0-9+.-]*://[^:/@\s]*:)[^\s/?#]*@")


def redact_url(url: str) -> str:
    """The URL with its password, if any, replaced by ``***``."""
    try:
        parts = urlsplit(url)
        if parts.password is None:
            return url
        host = parts.hostname or ""
        if ":" in host:
            host = f"[{host}]"
        netloc = f"{parts.username or ''}:***@{host}"
        if parts.port is not None:
            netloc += f":{parts.port}"
        return urlunsplit(parts._replace(netloc=netloc))
    except ValueError:
        return "<unparseable URL>"


def scrub(text: str) -> str:
    """``text`` with the password of every ``scheme://user:password@`` in it replaced by ``***``."""
    return _CREDENTIALS_IN_URL.sub(r"\g<prefix>***@", text)
