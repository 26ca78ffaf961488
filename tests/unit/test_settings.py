from datetime import timedelta

import pytest
from pydantic import ValidationError

from consumer.redact import redact_url, scrub
from consumer.settings import Settings, describe_settings_error


def settings(monkeypatch: pytest.MonkeyPatch, **env: str) -> Settings:
    for key in list(__import__("os").environ):
        if key.startswith("CONSUMER_"):
            monkeypatch.delenv(key)
    for key, value in env.items():
        monkeypatch.setenv(f"CONSUMER_{key.upper()}", value)
    return Settings()


def error_line(monkeypatch: pytest.MonkeyPatch, **env: str) -> str:
    with pytest.raises(ValidationError) as caught:
        settings(monkeypatch, **env)
    return describe_settings_error(caught.value)


def test_defaults_point_at_the_local_services(monkeypatch: pytest.MonkeyPatch) -> None:
    values = settings(monkeypatch)
    assert values.amqp_url.get_secret_value() == "amqp://guest:guest@127.0.0.1:5672/"
    assert values.database_url.get_secret_value().startswith("postgresql://postgres@127.0.0.1")
    assert values.name == "consumer"
    assert values.exchange == "events"
    assert values.retry_delays == (
        timedelta(seconds=1),
        timedelta(seconds=5),
        timedelta(seconds=30),
        timedelta(minutes=2),
        timedelta(minutes=10),
    )


def test_reads_durations_lists_and_case_insensitive_choices(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    values = settings(
        monkeypatch,
        retry_delays="200ms, 1s,2m",
        handler_timeout="500ms",
        hard_timeout="2",
        log_level="debug",
        log_format="JSON",
        handlers="a.b, c",
        prefetch="7",
    )
    assert values.retry_delays == (
        timedelta(milliseconds=200),
        timedelta(seconds=1),
        timedelta(minutes=2),
    )
    assert values.handler_timeout == timedelta(milliseconds=500)
    assert values.hard_timeout == timedelta(seconds=2)
    assert values.log_level == "DEBUG"
    assert values.log_format == "json"
    assert values.handlers == ("a.b", "c")
    assert values.prefetch == 7


@pytest.mark.parametrize(
    ("env", "names"),
    [
        ({"prefetch": "abc"}, "CONSUMER_PREFETCH"),
        ({"prefetch": "0"}, "CONSUMER_PREFETCH"),
        ({"retry_delays": "1s,5x"}, "CONSUMER_RETRY_DELAYS"),
        ({"retry_delays": "1s,1000ms"}, "CONSUMER_RETRY_DELAYS"),
        ({"log_level": "loud"}, "CONSUMER_LOG_LEVEL"),
        ({"handler_timeout": "0s"}, "CONSUMER_HANDLER_TIMEOUT"),
        ({"hard_timeout": "10s", "handler_timeout": "15s"}, "CONSUMER_HARD_TIMEOUT"),
        ({"name": "has space"}, "CONSUMER_NAME"),
        ({"amqp_url": "http://x"}, "CONSUMER_AMQP_URL"),
        ({"database_url": "mysql://x"}, "CONSUMER_DATABASE_URL"),
        ({"handlers": "not a module"}, "CONSUMER_HANDLERS"),
        ({"http_port": "70000"}, "CONSUMER_HTTP_PORT"),
    ],
)
def test_a_bad_value_gives_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], names: str
) -> None:
    line = error_line(monkeypatch, **env)
    assert "\n" not in line
    assert line.startswith("invalid setting ")
    assert names in line


def test_the_error_line_never_echoes_a_url(monkeypatch: pytest.MonkeyPatch) -> None:
    line = error_line(monkeypatch, amqp_url="http://user:hunter2@host/")
    assert "hunter2" not in line


def test_describe_hides_passwords(monkeypatch: pytest.MonkeyPatch) -> None:
    values = settings(
        monkeypatch,
        amqp_url="amqp://app:hunter2@broker:5672/vh",
        database_url="postgresql://app:s3cret@db/app",
    )
    described = values.describe()
    assert described["amqp_url"] == "amqp://app:***@broker:5672/vh"
    assert described["database_url"] == "postgresql://app:***@db/app"
    assert "hunter2" not in repr(values)
    assert "s3cret" not in repr(values)
    assert described["retry_delays"] == "1s,5s,30s,2m,10m"


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("amqp://u:p@h:1/v", "amqp://u:***@h:1/v"),
        ("amqp://h/v", "amqp://h/v"),
        ("postgresql://u@h/db", "postgresql://u@h/db"),
        ("amqps://u:p%40ss@[::1]:5671/", "amqps://u:***@[::1]:5671/"),
    ],
)
def test_redact_url(url: str, expected: str) -> None:
    assert redact_url(url) == expected


def test_scrub_replaces_every_password_in_free_text() -> None:
    text = "failed amqp://a:one@h and postgresql://b:two@db/x: refused"
    assert scrub(text) == "failed amqp://a:***@h and postgresql://b:***@db/x: refused"
