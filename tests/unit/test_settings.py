from datetime import timedelta

import pytest
from pydantic import SecretStr, ValidationError

from consumer.config.setting_errors import describe_settings_error, unknown_variables
from consumer.config.settings import Settings
from consumer.redact import redact_url, scrub
from consumer.service.components import broker_config


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
        ({"database_url": "postgresql://u@a:5432,b:5432/db"}, "CONSUMER_DATABASE_URL"),
        (
            {"database_url": "postgresql://u@a,b/db?target_session_attrs=prefer-standby"},
            "CONSUMER_DATABASE_URL",
        ),
        ({"handlers": "not a module"}, "CONSUMER_HANDLERS"),
        ({"http_port": "70000"}, "CONSUMER_HTTP_PORT"),
        ({"workers": "5", "db_pool_size": "4"}, "CONSUMER_WORKERS"),
    ],
)
def test_a_bad_value_gives_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], names: str
) -> None:
    line = error_line(monkeypatch, **env)
    assert "\n" not in line
    assert line.startswith("invalid setting ")
    assert names in line


@pytest.mark.parametrize(
    ("env", "value"),
    [
        ({"handler_timeout": "soon"}, "'soon'"),
        ({"retry_delays": "1s,5x"}, "'5x'"),
        ({"name": "has space"}, "'has space'"),
        ({"handlers": "a.b,not a module"}, "'not a module'"),
        ({"prefetch": "lots"}, "'lots'"),
        ({"batch_wait": "-1s"}, "'-1s'"),
    ],
)
def test_the_error_line_shows_the_bad_value_once(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], value: str
) -> None:
    line = error_line(monkeypatch, **env)
    assert line.count(value) == 1, line


def test_durations_take_compound_forms_and_days(monkeypatch: pytest.MonkeyPatch) -> None:
    values = settings(
        monkeypatch, shutdown_grace="1m30s", retry_delays="1s,1h30m,1d", max_future_skew="2d"
    )
    assert values.shutdown_grace == timedelta(seconds=90)
    assert values.retry_delays == (
        timedelta(seconds=1),
        timedelta(hours=1, minutes=30),
        timedelta(days=1),
    )
    assert values.max_future_skew == timedelta(days=2)


def test_an_empty_ladder_is_an_error_and_none_says_no_retries(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    line = error_line(monkeypatch, retry_delays="")
    assert line == (
        "invalid setting CONSUMER_RETRY_DELAYS: is empty: list the delays (1s,5s,30s), "
        "or say none for no retries"
    )
    assert settings(monkeypatch, retry_delays="none").retry_delays == ()
    assert settings(monkeypatch, retry_delays=" NONE ").retry_delays == ()


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("CONSUMER_PREFECH", "CONSUMER_PREFECH is not a setting (did you mean CONSUMER_PREFETCH?)"),
        (
            "CONSUMER_DATABSE_URL",
            "CONSUMER_DATABSE_URL is not a setting (did you mean CONSUMER_DATABASE_URL?)",
        ),
        (
            "consumer_loglevel",
            "consumer_loglevel is not a setting (did you mean CONSUMER_LOG_LEVEL?)",
        ),
        (
            "CONSUMER_WHATEVER",
            "CONSUMER_WHATEVER is not a setting (docs/operations/settings.md lists them)",
        ),
    ],
)
def test_an_unknown_variable_is_named_with_the_nearest_setting(name: str, message: str) -> None:
    assert unknown_variables({name: "postgresql://u:hunter2@db/x", "HOME": "/root"}) == [message]


def test_settings_and_other_programs_variables_are_not_unknown() -> None:
    environ = {
        "CONSUMER_PREFETCH": "10",
        "consumer_log_level": "debug",
        "CONSUMER_AMQP_URL_FILE": "/run/secrets/amqp",
        "CONSUMER_TEST_ADMIN_DSN": "postgresql://postgres@db/postgres",  # the test suite's
        "PATH": "/usr/bin",
    }
    assert unknown_variables(environ) == []


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


@pytest.mark.parametrize("wanted", ["read-write", "primary"])
def test_a_several_host_database_url_that_asks_for_the_primary_is_taken(wanted: str) -> None:
    url = f"postgresql://app:pw@db-a:5432,db-b:5432/app?target_session_attrs={wanted}"
    assert Settings(database_url=SecretStr(url)).database_url.get_secret_value() == url


def test_several_broker_nodes_become_one_url_each_in_the_order_given() -> None:
    nodes = [
        "amqp://app:pw@rabbit-1:5672/",
        "amqp://app:pw@rabbit-2:5672/",
        "amqp://app:pw@rabbit-3/",
    ]
    config = broker_config(Settings(amqp_url=SecretStr(" , ".join(nodes))))
    assert [url.get_secret_value() for url in config.urls] == nodes
    assert "pw" not in config.safe_url
    assert config.safe_url.count("rabbit-") == 3


def test_an_ack_timeout_of_whole_milliseconds_is_taken_exactly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # 512.002s is whole milliseconds, though its float seconds times 1000 is not a whole number.
    values = settings(monkeypatch, ack_timeout="512002ms")
    assert values.ack_timeout == timedelta(milliseconds=512_002)
    assert "whole milliseconds" in error_line(monkeypatch, ack_timeout="512002.5ms")


def test_a_duration_too_long_is_one_line_naming_the_setting(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    line = error_line(monkeypatch, receipt_retention="99999999999d")
    assert "RECEIPT_RETENTION" in line.upper()
    assert "too long" in line
    assert "\n" not in line
