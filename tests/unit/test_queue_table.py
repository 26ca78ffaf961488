"""The queue table (CONSUMER_QUEUES_FILE): parsing, per-queue settings, and the one line each
unusable table stops start-up with, naming the file, the queue and the key."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from consumer.config.queue_table import OVERRIDES, QueueTable, read_queue_table
from consumer.config.settings import Settings
from consumer.errors import QueueTableError
from consumer.registry import HandlerRegistry
from tests.support import REPO

TABLE = """
[queues.sms]
types = ["notification.sms", "notification.email"]
prefetch = 400

[queues.report]
types = ["report.build"]
prefetch = 1
workers = 1
handler_timeout = "10m"
hard_timeout = "11m"
retry_delays = ["30s", "5m"]
delivery_limit = 5
work_queue_version = 2
batch_size = 1
batch_wait = "0s"
db_pool_size = 2
receipt_retention = "720h"
ack_timeout = "20m"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "queues.toml"
    path.write_text(text)
    return path


def error_of(tmp_path: Path, text: str, settings: Settings | None = None) -> str:
    path = write(tmp_path, text)
    with pytest.raises(QueueTableError) as raised:
        read_queue_table(path, settings or Settings()).check_handlers(
            ["notification.sms", "notification.email", "report.build"]
        )
    message = str(raised.value)
    assert "\n" not in message
    assert message.startswith(f"invalid queue table {path}")
    return message


def test_each_queue_takes_its_types_and_its_own_settings(tmp_path: Path) -> None:
    # Given a table of two queues, one tuned for long work
    base = Settings(prefetch=50, retry_delays="1s,5s")

    table = read_queue_table(write(tmp_path, TABLE), base)

    # Then each row has its types, its overrides, and the service's other settings
    sms, report = table.queues
    assert (sms.name, sms.types) == ("sms", ("notification.sms", "notification.email"))
    assert sms.settings.prefetch == 400
    assert sms.settings.retry_delays == base.retry_delays
    assert report.settings.prefetch == 1
    assert report.settings.workers == 1
    assert report.settings.batch_size == 1
    assert report.settings.batch_wait == timedelta(0)
    assert report.settings.db_pool_size == 2
    assert report.settings.handler_timeout == timedelta(minutes=10)
    assert report.settings.hard_timeout == timedelta(minutes=11)
    assert report.settings.retry_delays == (timedelta(seconds=30), timedelta(minutes=5))
    assert report.settings.delivery_limit == 5
    assert report.settings.work_queue_version == 2
    assert report.settings.receipt_retention == timedelta(days=30)
    assert report.settings.ack_timeout == timedelta(minutes=20)
    assert sms.settings.ack_timeout is None
    assert report.settings.name == base.name
    # every key a row may set, in the order the table's reference lists them
    assert report.overrides == OVERRIDES
    assert table.queue_of("report.build") is report
    table.check_handlers(["notification.sms", "notification.email", "report.build"])


def test_a_row_without_overrides_is_the_service_settings(tmp_path: Path) -> None:
    base = Settings()
    table = read_queue_table(write(tmp_path, '[queues.a]\ntypes = ["a.b"]\n'), base)
    assert table.queues[0].settings is base


def test_a_time_limit_up_to_the_margin_is_taken(tmp_path: Path) -> None:
    text = '[queues.a]\ntypes = ["a.b"]\nhandler_timeout = "24m"\nhard_timeout = "25m"\n'
    (queue,) = read_queue_table(write(tmp_path, text), Settings()).queues
    assert queue.settings.hard_timeout == timedelta(minutes=25)


def test_without_a_file_one_queue_takes_every_type_under_todays_names() -> None:
    base = Settings(name="svc")

    table = QueueTable.default(base, ["b.x", "a.x"])

    (queue,) = table.queues
    assert queue.name is None
    assert queue.label == "svc"
    assert queue.types == ("a.x", "b.x")
    assert queue.settings is base


def test_retry_delays_may_be_the_settings_text(tmp_path: Path) -> None:
    text = '[queues.a]\ntypes = ["a.b"]\nretry_delays = "1s,5s"\n[queues.c]\ntypes = ["c.d"]\n'
    text += 'retry_delays = "none"\n'
    a, c = read_queue_table(write(tmp_path, text), Settings()).queues
    assert a.settings.retry_delays == (timedelta(seconds=1), timedelta(seconds=5))
    assert c.settings.retry_delays == ()


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        # an unknown key, in a queue and at the top
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nprefech = 3\n',
            "queue sms: prefech: unknown key (did you mean prefetch?)",
        ),
        ('colour = "red"\n', ": colour: unknown key"),
        # a bad value reads like the setting's own error
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nprefetch = 0\n',
            "queue sms: prefetch: Input should be greater than or equal to 1 (got 0)",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nhandler_timeout = "soon"\n',
            "queue sms: handler_timeout: is not a duration",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nretry_delays = ["5s", "5s"]\n',
            "queue sms: retry_delays: has the same delay twice (5s)",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nworkers = 9\n',
            "queue sms: workers: must be at most CONSUMER_DB_POOL_SIZE (4)",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nhandler_timeout = "1m"\n',
            "queue sms: hard_timeout: must be longer than CONSUMER_HANDLER_TIMEOUT (1m)",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nprefetch = true\n',
            "queue sms: prefetch: is not a switch",
        ),
        # a time limit near the broker's acknowledgement timeout
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nhandler_timeout = "26m"\n'
            'hard_timeout = "27m"\n',
            "queue sms: handler_timeout: 26m comes near RabbitMQ's delivery acknowledgement",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nhard_timeout = "40m"\n',
            "queue sms: hard_timeout: 40m comes near",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nhard_timeout = "40m"\n'
            'handler_timeout = "30m"\nack_timeout = "40m"\n',
            "queue sms: ack_timeout: must be at least CONSUMER_HARD_TIMEOUT (40m) plus 5m",
        ),
        # a retention the service's margin or partition does not fit in
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nreceipt_retention = "30m"\n',
            "queue sms: receipt_retention: 30m must be longer than CONSUMER_RECEIPT_MARGIN (1h)",
        ),
        (
            '[queues.sms]\ntypes = ["notification.sms"]\nreceipt_retention = "soon"\n',
            "queue sms: receipt_retention: is not a duration",
        ),
        # a type in two queues
        (
            '[queues.a]\ntypes = ["notification.sms"]\n[queues.b]\ntypes = ["notification.sms"]\n',
            "queue b: types: 'notification.sms' is also in queue a",
        ),
        # an event type with no handler
        (
            '[queues.a]\ntypes = ["notification.sms", "notification.email", "report.build",'
            ' "nobody.home"]\n',
            "queue a: types: 'nobody.home' has no handler",
        ),
        # a handler in no queue
        (
            '[queues.a]\ntypes = ["notification.sms", "notification.email"]\n',
            ": types: no queue takes 'report.build', which CONSUMER_HANDLERS handles",
        ),
        # the shape
        ("[queues.a]\nprefetch = 1\n", "queue a: types: is missing"),
        ("[queues.a]\ntypes = []\n", "queue a: types: must be a non-empty list"),
        ('[queues.a]\ntypes = ["Not A Type"]\n', "queue a: types: 'Not A Type' is not an event"),
        ('[queues."a.b"]\ntypes = ["a.b"]\n', "queue a.b: is not a usable queue name"),
        ("queues = 3\n", ": queues: no queue"),
        ("[queues]\n", ": queues: no queue"),
        ("[queues\n", ": is not TOML"),
    ],
    ids=[
        "unknown-key",
        "unknown-top-key",
        "bad-value",
        "bad-duration",
        "bad-ladder",
        "workers-over-pool",
        "soft-over-hard",
        "bool",
        "soft-near-ack-timeout",
        "hard-near-ack-timeout",
        "ack-timeout-under-hard",
        "retention-under-margin",
        "retention-not-a-duration",
        "type-in-two-queues",
        "type-without-handler",
        "handler-in-no-queue",
        "no-types",
        "empty-types",
        "bad-type",
        "bad-queue-name",
        "queues-not-a-table",
        "no-queue",
        "not-toml",
    ],
)
def test_an_unusable_table_is_one_line_naming_the_file_queue_and_key(
    tmp_path: Path, text: str, expected: str
) -> None:
    assert expected in error_of(tmp_path, text)


def test_a_missing_file_is_named(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.toml"
    with pytest.raises(QueueTableError, match=f"invalid queue table {path}: cannot read it"):
        read_queue_table(path, Settings())


def test_a_subset_keeps_the_named_queues_and_refuses_unknown_ones(tmp_path: Path) -> None:
    table = read_queue_table(write(tmp_path, TABLE), Settings())

    assert table.subset(["report"]).names == ("report",)
    assert table.subset(["report", "sms"]).names == ("sms", "report")
    with pytest.raises(QueueTableError, match="--queues: no queue 'pay'"):
        table.subset(["pay"])
    with pytest.raises(QueueTableError, match="--queues names no queue"):
        table.subset([])


def test_the_example_project_s_table_covers_its_handlers() -> None:
    table = read_queue_table(REPO / "examples" / "queues.toml", Settings())

    table.check_handlers(HandlerRegistry.from_modules(["billing.handlers"]))
    assert table.names == ("charges", "refunds", "invoices")


def test_a_queue_s_ack_timeout_allows_a_time_limit_past_the_broker_s(tmp_path: Path) -> None:
    # Given a queue whose handlers take up to 50 minutes, and its own acknowledgement timeout
    text = (
        '[queues.report]\ntypes = ["report.build"]\nhandler_timeout = "50m"\n'
        'hard_timeout = "55m"\nack_timeout = "1h"\n[queues.sms]\ntypes = ["notification.sms"]\n'
    )

    report, sms = read_queue_table(write(tmp_path, text), Settings()).queues

    # Then the table is taken: the limit is checked against the queue's own timeout
    assert report.settings.ack_timeout == timedelta(hours=1)
    assert sms.settings.ack_timeout is None


def test_a_raised_broker_timeout_is_declared_service_wide(tmp_path: Path) -> None:
    # Given rabbitmq.conf's consumer_timeout raised to 2 hours, and declared
    text = '[queues.report]\ntypes = ["report.build"]\nhandler_timeout = "90m"\n'
    text += 'hard_timeout = "95m"\n'

    # Then a 95-minute limit is taken under it, and refused under the default
    (report,) = read_queue_table(write(tmp_path, text), Settings(broker_ack_timeout="2h")).queues
    assert report.settings.hard_timeout == timedelta(minutes=95)
    with pytest.raises(QueueTableError, match="hard_timeout: 95m comes near"):
        read_queue_table(write(tmp_path, text.replace("handler_timeout", "batch_wait")), Settings())


def test_receipts_are_kept_for_the_longest_retention_of_the_table(tmp_path: Path) -> None:
    # Given a queue keeping its receipts a day, another a month, a third the service's week
    text = (
        '[queues.sms]\ntypes = ["notification.sms"]\nreceipt_retention = "24h"\n'
        '[queues.report]\ntypes = ["report.build"]\nreceipt_retention = "720h"\n'
        '[queues.mail]\ntypes = ["notification.email"]\n'
    )
    table = read_queue_table(write(tmp_path, text), Settings())
    sms, report, mail = table.queues

    # Then each queue's expiry check has its own retention
    assert sms.settings.receipt_retention == timedelta(days=1)
    assert report.settings.receipt_retention == timedelta(days=30)
    assert mail.settings.receipt_retention == timedelta(days=7)
    # And the one table is kept for the longest, by every deployment of a subset too
    assert table.receipt_retention == timedelta(days=30)
    assert table.subset(["sms"]).receipt_retention == timedelta(days=30)
    assert table.subset(["sms", "mail"]).subset(["sms"]).receipt_retention == timedelta(days=30)


def test_a_queue_held_behind_a_long_neighbour_past_its_ack_timeout_is_refused(
    tmp_path: Path,
) -> None:
    # Given a report queue of 20-minute tasks beside an sms queue of the broker's 30 minutes
    text = (
        '[queues.report]\ntypes = ["report.build"]\nhandler_timeout = "19m"\n'
        'hard_timeout = "20m"\n[queues.sms]\ntypes = ["notification.sms"]\n'
        'hard_timeout = "6m"\n'
    )
    table = read_queue_table(write(tmp_path, text), Settings())

    # Then running both in one process is refused, naming the two and the way out
    with pytest.raises(QueueTableError, match=r"queue report: hard_timeout: .* held 26m .*sms"):
        table.check_shared_waits()
    # And each alone (a process of its own) is taken
    table.subset(["report"]).check_shared_waits()
    table.subset(["sms"]).check_shared_waits()
    # As is the pair when sms's own hard limit leaves room
    read_queue_table(
        write(tmp_path, text.replace('hard_timeout = "6m"', 'hard_timeout = "4m"')), Settings()
    ).check_shared_waits()


def test_a_shard_subset_takes_those_shards_of_each_sharded_queue(tmp_path: Path) -> None:
    sharded = TABLE + '\n[queues.stock]\ntypes = ["inventory.reserve"]\nshards = 3\n'
    table = read_queue_table(write(tmp_path, sharded), Settings())
    stock = {queue.label: queue for queue in table.queues}["stock"]
    assert stock.consumed_shards == (1, 2, 3)

    subset = table.shard_subset([3, 1, 3])

    queues = {queue.label: queue for queue in subset.queues}
    assert queues["stock"].consumed_shards == (1, 3)
    # The unsharded queues run whole, and the table keeps its file and retention
    assert queues["sms"].consumed_shards == (1,)
    assert (subset.path, subset.receipt_retention) == (table.path, table.receipt_retention)
    with pytest.raises(QueueTableError, match="--shards: queue stock has shards 1 to 3, not 0, 4"):
        table.shard_subset([4, 0, 1])
    with pytest.raises(QueueTableError, match="--shards names no shard"):
        table.shard_subset([])
    with pytest.raises(QueueTableError, match="has no sharded queue"):
        read_queue_table(write(tmp_path, TABLE), Settings()).shard_subset([1])
