"""The security settings: URLs from secret files, TLS files checked at start-up, no password in
any repr or error line. No servers needed."""

from __future__ import annotations

import os
import ssl
from collections.abc import Callable
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import pytest
from pydantic import ValidationError

from consumer.config.setting_errors import describe_settings_error
from consumer.config.settings import Settings
from consumer.config.tls import amqp_ssl_context
from consumer.redact import redact_url, scrub
from consumer.service.components import broker_config, database_config
from tests.security.certs import Pki, make_pki
from tests.security.support import one_line_error, write_secret
from tests.support import REPO, run_cli

PASSWORD = "Hunter2-settings-canary"


@pytest.fixture(scope="module")
def files(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("settings-pki"))


def settings(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    for key in list(os.environ):
        if key.startswith("CONSUMER_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(f"CONSUMER_{key.upper()}", value)
    return Settings()


def error_line(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    with pytest.raises(ValidationError) as caught:
        settings(monkeypatch, **env)
    line = describe_settings_error(caught.value)
    assert "\n" not in line
    assert PASSWORD not in line
    return line


def cli_env(**values: str) -> dict[str, str]:
    base = {k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_")}
    return {
        **base,
        **{f"CONSUMER_{k.upper()}": v for k, v in values.items()},
        "PYTHONPATH": str(REPO),
    }


# -- secrets from files -----------------------------------------------------------------------


def test_urls_come_from_files_without_the_trailing_newline(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    amqp = write_secret(tmp_path, "amqp", f"amqp://app:{PASSWORD}@broker:5672/vh")
    database = tmp_path / "db"
    database.write_text(f"postgresql://app:{PASSWORD}@db/app\r\n")

    values = settings(monkeypatch, amqp_url_file=str(amqp), database_url_file=str(database))

    assert values.amqp_url.get_secret_value() == f"amqp://app:{PASSWORD}@broker:5672/vh"
    assert values.database_url.get_secret_value() == f"postgresql://app:{PASSWORD}@db/app"
    described = values.describe()
    assert described["amqp_url"] == "amqp://app:***@broker:5672/vh"
    assert described["amqp_url_file"] == str(amqp)
    assert PASSWORD not in repr(values)
    assert PASSWORD not in str(described)


def test_a_url_from_a_file_is_validated_like_one_from_the_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    bad = write_secret(tmp_path, "amqp", f"http://app:{PASSWORD}@broker/")
    line = error_line(monkeypatch, amqp_url_file=str(bad))
    assert line.startswith("invalid setting CONSUMER_AMQP_URL: must be an amqp://")


@pytest.mark.parametrize("setting", ["amqp_url", "database_url"])
def test_the_variable_and_its_file_together_are_one_line_naming_both_exit_2(
    setting: str, tmp_path: Path
) -> None:
    url = "amqp://u@h/" if setting == "amqp_url" else "postgresql://u@h/db"
    secret = write_secret(tmp_path, "url", url)

    result = run_cli(
        "topology",
        "apply",
        "--dry-run",
        env=cli_env(**{setting: url, f"{setting}_file": str(secret)}),
    )

    line = one_line_error(result, 2)
    name = f"CONSUMER_{setting.upper()}"
    assert f"{name} and {name}_FILE are both set" in line
    assert result.stdout == ""


@pytest.mark.parametrize(
    ("make", "reason", "command"),
    [
        (lambda folder: folder / "missing", "No such file or directory", ("consumer", "run")),
        (lambda folder: folder, "Is a directory", ("consumer", "migrate")),
        (lambda folder: write_secret(folder, "empty", ""), "is empty", ("topology", "apply")),
    ],
    ids=["missing", "directory", "empty"],
)
def test_an_unusable_secret_file_is_one_line_naming_the_setting_exit_2(
    make: Callable[[Path], Path], reason: str, command: tuple[str, ...], tmp_path: Path
) -> None:
    path = make(tmp_path)

    result = run_cli(*command, env=cli_env(database_url_file=str(path)))

    line = one_line_error(result, 2)
    assert line.startswith("error: invalid setting CONSUMER_DATABASE_URL_FILE: ")
    assert str(path) in line
    assert reason in line


# -- TLS settings -----------------------------------------------------------------------------


def test_amqps_verifies_the_chain_and_the_host_by_default(
    monkeypatch: pytest.MonkeyPatch, files: Pki
) -> None:
    values = settings(
        monkeypatch,
        amqp_url="amqps://u:p@broker.example:5671/",
        amqp_ca_file=str(files.ca),
        amqp_cert_file=str(files.client_cert),
        amqp_key_file=str(files.client_key),
    )
    context = amqp_ssl_context(broker_config(values).tls)
    assert context is not None
    assert context.verify_mode == ssl.CERT_REQUIRED
    assert context.check_hostname is True
    assert context.minimum_version >= ssl.TLSVersion.TLSv1_2

    opted_out = settings(
        monkeypatch, amqp_url="amqps://u:p@broker:5671/", amqp_verify_hostname="false"
    )
    context = amqp_ssl_context(broker_config(opted_out).tls)
    assert context is not None
    assert context.check_hostname is False
    assert context.verify_mode == ssl.CERT_REQUIRED  # the chain is still checked

    assert amqp_ssl_context(broker_config(settings(monkeypatch)).tls) is None  # amqp://: no TLS


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        (
            {"amqp_ca_file": "{ca}"},
            "CONSUMER_AMQP_CA_FILE: is set but CONSUMER_AMQP_URL is not an amqps://",
        ),
        (
            {"amqp_url": "amqps://u:{pw}@h/", "amqp_ca_file": "{key}"},
            "CONSUMER_AMQP_CA_FILE: {key} holds no PEM CA certificate",
        ),
        (
            {"amqp_url": "amqps://u:{pw}@h/", "amqp_ca_file": "/nonexistent/ca.pem"},
            "CONSUMER_AMQP_CA_FILE: cannot read /nonexistent/ca.pem: No such file",
        ),
        (
            {"amqp_url": "amqps://u:{pw}@h/", "amqp_cert_file": "{cert}"},
            "CONSUMER_AMQP_KEY_FILE: is needed with CONSUMER_AMQP_CERT_FILE",
        ),
        (
            {"amqp_url": "amqps://u:{pw}@h/", "amqp_key_file": "{key}"},
            "CONSUMER_AMQP_KEY_FILE: is set without CONSUMER_AMQP_CERT_FILE",
        ),
        (
            {
                "amqp_url": "amqps://u:{pw}@h/",
                "amqp_cert_file": "{cert}",
                "amqp_key_file": "{other_key}",
            },
            "CONSUMER_AMQP_KEY_FILE: cannot load {other_key} with CONSUMER_AMQP_CERT_FILE",
        ),
        (
            {"amqp_url": "amqps://u:{pw}@h/?cafile=/x.pem&no_verify_ssl=1"},
            "CONSUMER_AMQP_URL: TLS options in the URL (cafile, no_verify_ssl) are not used",
        ),
        (
            {"database_sslrootcert": "{ca}"},
            "CONSUMER_DATABASE_SSLROOTCERT: is set but sslmode is prefer, which never checks",
        ),
        (
            {"database_sslmode": "allow", "database_sslrootcert": "{ca}"},
            "CONSUMER_DATABASE_SSLROOTCERT: is set but sslmode is allow",
        ),
        ({"database_sslmode": "very-secure"}, "CONSUMER_DATABASE_SSLMODE: Input should be"),
        ({"amqp_url": "amqp://u:{pw}@:5672/"}, "CONSUMER_AMQP_URL: names no host"),
        ({"amqp_url": "amqp://u:{pw}@h:99999/"}, "CONSUMER_AMQP_URL: has a port that is not"),
        ({"database_url": "postgresql://u:{pw}@h:port/db"}, "CONSUMER_DATABASE_URL: has a port"),
        ({"http_host": ""}, "CONSUMER_HTTP_HOST: is empty (to listen on every interface say"),
    ],
)
def test_a_bad_security_setting_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, files: Pki, env: dict[str, str], expected: str
) -> None:
    names = {
        "ca": files.ca,
        "cert": files.client_cert,
        "key": files.client_key,
        "other_key": files.server_key,
        "pw": PASSWORD,
    }
    line = error_line(monkeypatch, **{k: v.format(**names) for k, v in env.items()})
    assert expected.format(**names) in line


def test_the_database_tls_settings_go_into_the_dsn_and_win_over_the_url(
    monkeypatch: pytest.MonkeyPatch, files: Pki
) -> None:
    url = f"postgresql://app:{PASSWORD}@db:5432/app?sslmode=prefer&application_name=x"
    values = settings(
        monkeypatch,
        database_url=url,
        database_sslmode="VERIFY-FULL",
        database_sslrootcert=str(files.ca),
    )
    query = parse_qs(urlsplit(database_config(values).dsn).query)
    assert query == {
        "sslmode": ["verify-full"],
        "sslrootcert": [str(files.ca)],
        "application_name": ["x"],
    }
    assert database_config(values).dsn.startswith(f"postgresql://app:{PASSWORD}@db:5432/app?")
    # Left alone, the URL is used as it is, its own sslmode included.
    assert database_config(settings(monkeypatch, database_url=url)).dsn == url
    verified = settings(
        monkeypatch,
        database_url=url.replace("prefer", "verify-ca"),
        database_sslrootcert=str(files.ca),
    )
    assert "sslmode=verify-ca" in database_config(verified).dsn


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("at amqp://u:p@ss@host/vh refused", "at amqp://u:***@host/vh refused"),
        ("amqp://u:pw@h:1/?x=a@b and x@y", "amqp://u:***@h:1/?x=a@b and x@y"),
        ("postgresql://u:p%40ss@db/x", "postgresql://u:***@db/x"),
    ],
)
def test_scrub_hides_a_password_with_an_at_sign_whole(text: str, expected: str) -> None:
    assert scrub(text) == expected
    assert redact_url("amqp://u:p@ss@host/vh") == "amqp://u:***@host/vh"


# -- the management API's URL -------------------------------------------------------------------


def test_a_bad_management_url_is_named_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    line = error_line(monkeypatch, management_url=f"ftp://u:{PASSWORD}@broker:15672")
    assert line == (
        "invalid setting CONSUMER_MANAGEMENT_URL: must be an http:// or https:// URL naming a host"
    )


def test_the_management_url_is_logged_without_its_password(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = settings(monkeypatch, management_url=f"http://u:{PASSWORD}@broker:15672")
    assert values.describe()["management_url"] == "http://u:***@broker:15672"
    assert PASSWORD not in repr(values)
