"""TLS for the connections to RabbitMQ and PostgreSQL, from the files and modes configured.

RabbitMQ: an ``amqps://`` URL gets an :class:`ssl.SSLContext` that trusts the CA file
(``CONSUMER_AMQP_CA_FILE``, else the system's CAs), presents a client certificate and key when
given, and checks that the certificate names the URL's host unless told not to. The chain is always
verified.

PostgreSQL: an ``sslmode`` and ``sslrootcert`` given become the DSN's (libpq's meaning, which
asyncpg follows), replacing any in the URL. A certificate the client rejects is a
:class:`CertificateRejected`: waiting will not fix it.
"""

from __future__ import annotations

import ssl
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

import asyncpg

from consumer.errors import ConfigError

__all__ = [
    "CertificateRejected",
    "DatabaseConnect",
    "TlsFiles",
    "amqp_ssl_context",
    "database_connector",
    "database_dsn",
    "describe_tls_error",
    "find_tls_error",
    "no_passphrase",
]

DatabaseConnect = Callable[..., Coroutine[Any, Any, "asyncpg.Connection[Any]"]]


class CertificateRejected(ConfigError):
    """The server's TLS certificate did not verify (wrong CA, or it does not name the host)."""


def no_passphrase() -> bytes:
    """The password callback for keys: an encrypted key fails instead of OpenSSL prompting."""
    return b""


@dataclass(frozen=True, slots=True)
class TlsFiles:
    """TLS to RabbitMQ: the CA to trust (None: the system's), a client certificate and key."""

    ca_file: Path | None = None
    cert_file: Path | None = None
    key_file: Path | None = None
    verify_hostname: bool = True


def amqp_ssl_context(tls: TlsFiles | None) -> ssl.SSLContext | None:
    """The context for an ``amqps://`` URL (``tls`` given); None for ``amqp://``. Raises OSError,
    ssl.SSLError."""
    if tls is None:
        return None
    cafile = str(tls.ca_file) if tls.ca_file is not None else None
    context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=cafile)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    if tls.cert_file is not None and tls.key_file is not None:
        context.load_cert_chain(str(tls.cert_file), str(tls.key_file), password=no_passphrase)
    # Verifying the chain stays on (CERT_REQUIRED); only the name check can be turned off.
    context.check_hostname = tls.verify_hostname
    return context


def database_dsn(url: str, *, sslmode: str | None = None, sslrootcert: Path | None = None) -> str:
    """``url`` with ``sslmode`` and ``sslrootcert`` in its query (they win over the URL's)."""
    overrides: dict[str, str] = {}
    if sslmode is not None:
        overrides["sslmode"] = sslmode
    if sslrootcert is not None:
        overrides["sslrootcert"] = str(sslrootcert)
    if not overrides:
        return url
    parts = urlsplit(url)
    query = [(key, value) for key, value in parse_qsl(parts.query) if key not in overrides]
    query.extend(overrides.items())
    return urlunsplit(parts._replace(query=urlencode(query)))


def find_tls_error(error: BaseException) -> ssl.SSLError | None:
    """The :class:`ssl.SSLError` behind ``error`` (libraries wrap it), if there is one."""
    seen: set[int] = set()
    current: BaseException | None = error
    while current is not None and id(current) not in seen:
        if isinstance(current, ssl.SSLError):
            return current
        seen.add(id(current))
        current = current.__cause__ or current.__context__
    return None


def describe_tls_error(error: ssl.SSLError) -> str:
    """One short phrase: what TLS refused, without OpenSSL's source locations."""
    if isinstance(error, ssl.SSLCertVerificationError):
        reason = str(error.verify_message or error.reason or "verify failed").rstrip(".")
        return f"the server's TLS certificate was rejected: {reason}"
    reason = str(error.reason or error.strerror or type(error).__name__)
    return f"TLS failed: {reason.replace('_', ' ').lower()}"


def database_connector(safe_url: str) -> DatabaseConnect:
    """``asyncpg.connect`` that turns a rejected certificate into :class:`CertificateRejected`
    (``safe_url``, without its password, names the server in the error).

    Given to the pool (``connect=``) and used by ``migrate``: a wrong CA stops start-up with one
    line instead of passing for an outage.
    """

    async def connect(*args: Any, **kwargs: Any) -> asyncpg.Connection[Any]:
        try:
            connection: asyncpg.Connection[Any] = await asyncpg.connect(*args, **kwargs)
        except ssl.SSLCertVerificationError as error:
            raise CertificateRejected(
                f"cannot connect to PostgreSQL at {safe_url}: "
                f"{describe_tls_error(error)} (check CONSUMER_DATABASE_SSLROOTCERT and "
                "CONSUMER_DATABASE_SSLMODE)"
            ) from None
        except asyncpg.ClientConfigurationError as error:
            # sslmode needs a root certificate that is not there, and similar.
            raise ConfigError(
                f"CONSUMER_DATABASE_URL/CONSUMER_DATABASE_SSLMODE: {str(error).rstrip('.')}"
            ) from None
        return connection

    return connect
