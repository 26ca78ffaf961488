"""The service's settings: one typed object, read from ``CONSUMER_*`` environment variables once in
``main()`` and passed to whatever needs it.

Durations are written with a unit (``500ms``, ``5s``, ``2m``, ``1h``, ``1d``, or compounds such as
``1m30s``; a bare number is seconds). Choices such as the log level are case-insensitive. A bad
value raises ``pydantic.ValidationError``;
:func:`consumer.config.setting_errors.describe_settings_error` turns it into the one line start-up
prints, and :func:`consumer.config.setting_errors.unknown_variables` finds the ``CONSUMER_*``
variables that are not settings. How each value is parsed and checked is in
:mod:`consumer.config.setting_values`.
"""

from __future__ import annotations

import ssl
from datetime import timedelta
from pathlib import Path
from typing import Annotated, Any
from urllib.parse import parse_qs, unquote, urlsplit

from pydantic import (
    AfterValidator,
    BeforeValidator,
    ByteSize,
    Field,
    SecretStr,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from consumer.config.setting_values import (
    ENV_PREFIX,
    NAME,
    SECRET_FROM_FILE,
    VERIFYING_SSLMODES,
    WRITABLE_SESSIONS,
    Duration,
    LogFormat,
    LogLevel,
    SslMode,
    check_one_amqp_url,
    env_name,
    module_name,
    read_secret_file,
    readable_file,
    split_ladder,
    split_list,
    split_urls,
)
from consumer.config.tls import no_passphrase
from consumer.durations import parse_duration
from consumer.redact import redact_url
from topology.durations import format_duration

__all__ = [
    "ACK_TIMEOUT_MARGIN",
    "DEFAULT_HANDLER_MODULES",
    "ENV_PREFIX",
    "VERIFYING_SSLMODES",
    "Duration",
    "LogFormat",
    "LogLevel",
    "Settings",
    "SslMode",
    "split_urls",
]

ACK_TIMEOUT_MARGIN = timedelta(minutes=5)
"""What a delivery needs besides its handler's time before it is acknowledged: the batch's wait,
its commit, the settle. A time limit ends this long before the acknowledgement timeout."""

DEFAULT_HANDLER_MODULES = (
    "consumer.handlers.inventory",
    "consumer.handlers.notifications",
)


class Settings(BaseSettings):
    """Everything the service can be told. Field ``x`` is read from ``CONSUMER_X``."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        case_sensitive=False,
        frozen=True,
        extra="ignore",
    )

    amqp_url: SecretStr = SecretStr("amqp://guest:guest@127.0.0.1:5672/")
    """RabbitMQ; a cluster's nodes comma-separated (each connection tries them in turn, starting
    after the last one that failed)."""
    database_url: SecretStr = SecretStr("postgresql://postgres@127.0.0.1:5432/consumer")
    """PostgreSQL; several hosts comma-separated in the URL (`host1,host2`) for a failover pair
    (the primary is found by asking)."""
    name: str = "consumer"
    """Prefix of every queue and exchange the service owns, and the `consumer` column of its
    receipts."""
    exchange: str = "events"
    """The ingress topic exchange."""
    prefetch: int = Field(default=400, ge=1, le=65535)
    """Deliveries in flight per process (the consume channel's QoS); at the default, eight full
    batches, so the next ones fill while one commits; the workers and the batch size follow
    from it unless set."""
    db_pool_size: int = Field(default=4, ge=1, le=1000)
    """The pool's connections, and the most workers."""
    workers: int | None = Field(default=None, ge=1, le=1000)
    """Workers, each applying one batch at a time on a connection of its own. Unset: chosen as
    the service runs from its handlers' measured time, between one and ``CONSUMER_DB_POOL_SIZE``
    (:mod:`consumer.service.concurrency`): handlers that await I/O get more, batch and CPU-bound
    ones one. Set: pinned."""
    batch_size: int | None = Field(default=None, ge=1, le=1000)
    """The most events a batch (one transaction) takes. Unset: chosen as the service runs
    (:mod:`consumer.service.concurrency`): the workers' share of the prefetch window, at most 50,
    and smaller for handlers that await I/O. Set: pinned."""
    batch_wait: Annotated[timedelta, BeforeValidator(parse_duration)] | None = None
    """The longest a batch waits for the broker's refill of a prefetch window it settled full
    (the only wait left: a worker takes what arrived while its last batch ran, and an idle one
    goes with the first arrival). Unset: decided from the measured gaps between arrivals and the
    measured time of a batch (:class:`consumer.service.inbox.Inbox`). ``0s``: never wait."""
    batch_lock_timeout: Duration = timedelta(milliseconds=100)
    """A batch waiting longer than this for another transaction's row lock commits what it has
    and goes round again."""
    db_stall_timeout: Duration = timedelta(seconds=5)
    """The service's own statements (BEGIN, receipts, COMMIT) taking longer mean the database
    stalled: pause."""
    http_host: str = "127.0.0.1"
    """Where `/metrics`, `/healthz` and `/readyz` listen."""
    http_port: int = Field(default=8080, ge=1, le=65535)
    """The port of `/metrics`, `/healthz` and `/readyz`."""
    retry_delays: Annotated[tuple[Duration, ...], NoDecode, BeforeValidator(split_ladder)] = (
        timedelta(seconds=1),
        timedelta(seconds=5),
        timedelta(seconds=30),
        timedelta(minutes=2),
        timedelta(minutes=10),
    )
    """The retry ladder: one delay queue per rung; `none` for no retries (an empty value is an
    error)."""
    retry_jitter: float = Field(default=0.0, ge=0.0, le=1.0)
    """Fraction (0-1) by which a retry's wait may be shortened at random."""
    delivery_limit: int = Field(default=20, ge=1, le=1000)
    """The work queue's `x-delivery-limit` (crash loops; see Dead letters for why not lower)."""
    work_queue_version: int = Field(default=1, ge=1, le=1_000_000)
    """The work queue's generation: `1` is `<name>.work`, `n` is `<name>.work.v<n>`; a new
    delivery limit needs a new one (see Changing the topology)."""
    quorum_initial_group_size: int | None = Field(default=None, ge=1, le=99)
    """Replicas of each quorum queue when `consumer topology apply` creates it (fixed at
    creation: a different value for an existing queue is reported as a conflict). Unset: the
    broker's default."""
    handlers: Annotated[
        tuple[Annotated[str, AfterValidator(module_name)], ...],
        NoDecode,
        BeforeValidator(split_list),
    ] = DEFAULT_HANDLER_MODULES
    """Handler modules to load, comma-separated; `consumer migrate` applies the migration folder
    each declares (`MIGRATIONS`), in this order. The default is the reference handlers."""
    management_url: SecretStr | None = None
    """RabbitMQ's management HTTP API (`http://user:password@host:15672`), for `consumer
    topology check` to compare the broker's bindings with the plan (AMQP cannot list them; the
    user needs the `monitoring` tag). Unset: the check compares exchanges and queues, and says
    that it did not compare the bindings."""
    queues_file: Path | None = None
    """The queue table: a TOML file of `[queues.<name>]` tables, each listing the event `types`
    it takes and what of `prefetch`, `workers`, `batch_size`, `batch_wait`, `handler_timeout`,
    `hard_timeout`, `retry_delays`, `delivery_limit`, `work_queue_version`, `db_pool_size`,
    `receipt_retention` and `ack_timeout` it sets for itself (see The queue table). Unset: one
    work queue for every type, as before."""
    handler_timeout: Duration = timedelta(seconds=15)
    """Soft time limit per handler (`register(..., timeout=)` overrides)."""
    hard_timeout: Duration = timedelta(seconds=20)
    """Event loop blocked this long: the process exits (code 3)."""
    broker_ack_timeout: Duration = timedelta(minutes=30)
    """RabbitMQ's delivery acknowledgement timeout (`consumer_timeout` in `rabbitmq.conf`; 30
    minutes by default), declared, not set: a queue's time limit must end 5 minutes before it.
    Raised there, declare it here (see The queue table, Long work)."""
    ack_timeout: Duration | None = None
    """The work queue's own delivery acknowledgement timeout, set by `consumer topology apply`
    (queue argument `x-consumer-timeout`, RabbitMQ 3.12 and later; an older broker is refused at
    start-up), at least the hard time limit plus 5 minutes. Unset: the broker's (see The queue
    table, Long work)."""
    shutdown_grace: Duration = timedelta(seconds=30)
    """Time in-flight events get to finish after SIGTERM."""
    publish_timeout: Duration = timedelta(seconds=10)
    """Wait for a publisher confirm."""
    reconnect_max_delay: Duration = timedelta(seconds=30)
    """Cap of the reconnect and database-probe backoff."""
    max_body_bytes: int = Field(default=256 * 1024, ge=64, le=128 * 1024 * 1024)
    """Larger bodies are poison (`body_too_large`), refused on the size their content header
    declares and dropped unread as they arrive; set the broker's `max_message_size` to match
    (`deploy/README.md`, "Message size")."""
    max_json_depth: int = Field(default=32, ge=2, le=512)
    """Deeper nesting is poison (`too_deep`)."""
    max_json_containers: int = Field(default=10_000, ge=10, le=10_000_000)
    """A body with more objects and arrays is poison (`too_complex`), counted before it is
    parsed."""
    # What the process may use, to budget prefetched bodies against (consumer.service.memory);
    # unset: the container's limit (cgroup) if it has one.
    memory_limit: ByteSize | None = None
    """What the process may use (`512MiB`): start-up refuses settings whose worst case does not
    fit (see Security). Unset: the container's limit (cgroup), if any."""
    max_header_bytes: int = Field(default=64 * 1024, ge=1024, le=16 * 1024 * 1024)
    """Larger message headers are poison (`headers_too_large`), refused by their length on the
    wire before they are decoded (as are headers of more than 1,024 entries)."""
    max_future_skew: Duration = timedelta(hours=24)
    """An `occurred_at` further ahead of this host's clock is poison (`invalid_envelope`)."""
    # Receipts retention (consumer.db.retention): how long a receipt is kept, how much sooner than
    # that an event is refused as expired, the span of one partition, and how often one replica
    # drops the partitions past the retention.
    receipt_retention: Duration = timedelta(days=7)
    """Receipts are kept this long past their event's `occurred_at`, then dropped a whole
    partition at a time (see Receipts retention)."""
    receipt_margin: Duration = timedelta(hours=1)
    """An event older than the retention less this is never applied: dead-lettered `expired`;
    covers a batch's wait, a retry in flight and the service's clock against the database's
    (shorter than the retention)."""
    max_clock_skew: Duration = timedelta(minutes=1)
    """How far this host's clock may be from the database's (`clock_timestamp()`): further, and
    `consumer run` refuses to start, one line naming the skew; every prune round measures again
    (a warning and `consumer_clock_ahead_seconds`). Shorter than the margin, which covers it (see
    Clock skew)."""
    # An hour: the partition being written stays small, and the receipt insert costs with a week
    # of receipts kept what it costs in an empty table (docs/performance.md).
    receipt_partition: Duration = timedelta(hours=1)
    """The span of one receipts partition (whole seconds, at most the retention); applies to
    partitions made from now on."""
    receipt_prune_interval: Duration = timedelta(minutes=10)
    """How often a replica (one at a time) makes partitions ahead and drops those past the
    retention."""
    # How long a prune waits for the receipts' lock: inserts queued behind it wait as long.
    receipt_prune_lock_wait: Duration = timedelta(milliseconds=200)
    """How long a prune waits for the receipts' lock (inserts queued behind it wait as long); a
    round refused it changes nothing and is tried at the next interval: raise it where
    transactions often last longer."""
    # The outbox relay (consumer.service.outbox_relay): publishes the committed rows of the
    # outbox table (sql/008) to the ingress exchange.
    outbox_relay: bool = True
    """`on` or `off`: the outbox relay inside the service, publishing the outbox's committed rows
    to the ingress exchange with publisher confirms (see The outbox relay). Off: rows written to
    the outbox wait for a replica with it on."""
    outbox_batch_size: int = Field(default=100, ge=1, le=10_000)
    """The most outbox rows one relay round takes, publishes and marks sent in one transaction."""
    outbox_poll: Duration = timedelta(seconds=5)
    """How often the relay looks for unsent rows without being woken: the fallback for a
    notification lost (the relay wakes on every commit that wrote rows)."""
    allow_extra_fields: bool = False
    """Accept (and ignore) unknown top-level envelope fields."""
    log_level: LogLevel = "INFO"
    """`DEBUG`, `INFO`, `WARNING`, `ERROR`."""
    log_format: LogFormat = "auto"
    """`json`, `console`, or `auto` (console on a terminal)."""
    log_payloads: bool = False
    """Include payloads in the per-message log line."""
    # Read by _secrets_from_files before anything else; kept to show where the URL came from.
    amqp_url_file: Path | None = None
    """Read `CONSUMER_AMQP_URL` from this file instead (a Docker or Kubernetes secret), without
    its trailing newline; setting both the variable and its `_FILE` is an error."""
    database_url_file: Path | None = None
    """Read `CONSUMER_DATABASE_URL` from this file instead (a Docker or Kubernetes secret),
    without its trailing newline; setting both the variable and its `_FILE` is an error."""
    # TLS to RabbitMQ (amqps:// URLs): the CA to trust (default: the system's), a client
    # certificate and key, and whether the URL's host must be named in the broker's certificate.
    amqp_ca_file: Path | None = None
    """PEM CA certificates to verify an `amqps://` broker with (the chain is always verified).
    Unset: the system's CAs."""
    amqp_cert_file: Path | None = None
    """Client certificate, for a broker that asks for one (`amqps://` only)."""
    amqp_key_file: Path | None = Field(default=None, validate_default=True)
    """The client certificate's unencrypted key (`amqps://` only)."""
    amqp_verify_hostname: bool = True
    """The broker's certificate must name the URL's host; `false` checks only that a trusted CA
    signed it."""
    # aiormq's frame receiver and channel replaced by faster ones (consumer.amqp.fast_paths);
    # false runs on aiormq's own code: slower, otherwise the same.
    amqp_fast_path: bool = True
    """Read frames in bulk and hand deliveries over from the channel's reader, in place of
    aiormq's own code (`consumer.amqp.fast_paths`); `false` runs on aiormq's: slower,
    otherwise the same, but for one bound: a body over `CONSUMER_MAX_BODY_BYTES` is then read
    whole before it is refused (the same `body_too_large` nack), not dropped as it arrives.
    Start-up falls back by itself, with a warning, where aiormq's private code is not what
    they replace. The hardened header decoders stay on either way."""
    # TLS to PostgreSQL, libpq's meaning; they override sslmode= and sslrootcert= in the URL.
    database_sslmode: SslMode | None = None
    """libpq's `disable`, `allow`, `prefer`, `require`, `verify-ca`, `verify-full` (use
    `verify-full`); wins over the URL's. Unset: the URL's `sslmode`, else `prefer`."""
    database_sslrootcert: Path | None = Field(default=None, validate_default=True)
    """CA certificate(s) to verify PostgreSQL with; needs `require`, `verify-ca` or
    `verify-full`. Unset: the URL's `sslrootcert`."""

    @model_validator(mode="before")
    @classmethod
    def _secrets_from_files(cls, data: Any) -> Any:
        """``CONSUMER_AMQP_URL_FILE`` and ``CONSUMER_DATABASE_URL_FILE``: the URL from a file."""
        if not isinstance(data, dict):
            return data
        data = dict(data)
        for field in SECRET_FROM_FILE:
            path = data.get(f"{field}_file")
            if path is None or path == "":
                continue
            if data.get(field) not in (None, ""):
                name = env_name(field)
                raise ValueError(f"{name} and {name}_FILE are both set: set only one of them")
            data[field] = read_secret_file(field, path)
        return data

    @field_validator("amqp_url")
    @classmethod
    def _check_amqp_url(cls, value: SecretStr) -> SecretStr:
        urls = split_urls(value.get_secret_value())
        if not urls:
            raise ValueError("is empty")
        schemes = set()
        for url in urls:
            check_one_amqp_url(url, several=len(urls) > 1)
            schemes.add(urlsplit(url).scheme)
        if len(schemes) > 1:
            # One set of TLS files serves every node: a mixed list would silently drop TLS.
            raise ValueError("mixes amqp:// and amqps:// URLs: use one scheme for every node")
        return value

    @field_validator("database_url")
    @classmethod
    def _check_database_url(cls, value: SecretStr) -> SecretStr:
        parts = urlsplit(value.get_secret_value())
        if parts.scheme not in ("postgres", "postgresql"):
            raise ValueError("must be a postgresql:// URL")
        if "," not in parts.netloc:  # several hosts: asyncpg parses them itself
            try:
                parts.port  # noqa: B018 - raises on a port that is not a number in range
            except ValueError:
                raise ValueError("has a port that is not a number from 0 to 65535") from None
            return value
        # With several hosts asyncpg takes the first that answers, a standby too: every write
        # would then fail as if the event were at fault, and be dead-lettered.
        wanted = parse_qs(parts.query).get("target_session_attrs", ["any"])[-1]
        if wanted not in WRITABLE_SESSIONS:
            raise ValueError(
                "names several hosts: add target_session_attrs=read-write so that the service "
                "only ever writes to the primary"
            )
        return value

    @field_validator("management_url")
    @classmethod
    def _check_management_url(cls, value: SecretStr | None) -> SecretStr | None:
        if value is None:
            return None
        parts = urlsplit(value.get_secret_value())
        if parts.scheme not in ("http", "https") or not parts.hostname:
            raise ValueError("must be an http:// or https:// URL naming a host")
        return value

    @field_validator("http_host")
    @classmethod
    def _check_http_host(cls, value: str) -> str:
        if not value.strip():
            # aiohttp would listen on every interface: say so explicitly if that is wanted.
            raise ValueError("is empty (to listen on every interface say 0.0.0.0 or ::)")
        return value

    @field_validator("amqp_ca_file", "amqp_cert_file")
    @classmethod
    def _check_amqp_tls_file(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        url = info.data.get("amqp_url")
        if url is not None and urlsplit(url.get_secret_value()).scheme != "amqps":
            raise ValueError("is set but CONSUMER_AMQP_URL is not an amqps:// (TLS) URL")
        readable_file(value)
        if info.field_name == "amqp_ca_file":
            try:
                ssl.create_default_context(cafile=str(value))
            except ssl.SSLError:
                raise ValueError(f"{value} holds no PEM CA certificate") from None
        return value

    @field_validator("amqp_key_file")
    @classmethod
    def _check_amqp_key(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        cert = info.data.get("amqp_cert_file")
        if value is None:
            if cert is not None:
                raise ValueError("is needed with CONSUMER_AMQP_CERT_FILE")
            return None
        if cert is None:
            if "amqp_cert_file" in info.data:  # not merely invalid: missing
                raise ValueError("is set without CONSUMER_AMQP_CERT_FILE")
            return value
        readable_file(value)
        try:
            ssl.create_default_context().load_cert_chain(
                str(cert), str(value), password=no_passphrase
            )
        except ssl.SSLError:
            raise ValueError(
                f"cannot load {value} with CONSUMER_AMQP_CERT_FILE (both PEM, the key "
                "unencrypted and the certificate's own)"
            ) from None
        return value

    @field_validator("database_sslrootcert")
    @classmethod
    def _check_sslrootcert(cls, value: Path | None, info: ValidationInfo) -> Path | None:
        if value is None:
            return None
        readable_file(value)
        mode = info.data.get("database_sslmode")
        url = info.data.get("database_url")
        if mode is None and url is not None:
            given = parse_qs(urlsplit(url.get_secret_value()).query).get("sslmode")
            mode = given[-1] if given else "prefer"
        if mode is not None and mode not in VERIFYING_SSLMODES:
            raise ValueError(
                f"is set but sslmode is {mode}, which never checks the server's certificate: "
                "set CONSUMER_DATABASE_SSLMODE=verify-full"
            )
        return value

    @field_validator("name", "exchange")
    @classmethod
    def _check_name(cls, value: str) -> str:
        if not NAME.match(value):
            raise ValueError("is not a usable name (letters, digits, '_', '.', '-'; at most 100)")
        return value

    @field_validator("retry_delays")
    @classmethod
    def _check_ladder(cls, value: tuple[timedelta, ...]) -> tuple[timedelta, ...]:
        names = [format_duration(delay) for delay in value]
        twice = sorted({name for name in names if names.count(name) > 1})
        if twice:
            raise ValueError(f"has the same delay twice ({', '.join(twice)})")
        if any(delay.total_seconds() * 1000 % 1 for delay in value):
            raise ValueError("delays are whole milliseconds")
        return value

    @field_validator("workers")
    @classmethod
    def _check_workers(cls, value: int | None, info: ValidationInfo) -> int | None:
        pool = info.data.get("db_pool_size")
        if value is not None and pool is not None and value > pool:
            raise ValueError(
                f"must be at most CONSUMER_DB_POOL_SIZE ({pool}): each worker holds a connection"
            )
        return value

    @field_validator("handlers")
    @classmethod
    def _check_handlers(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise ValueError("name at least one handler module")
        return value

    @field_validator("ack_timeout")
    @classmethod
    def _check_ack_timeout(cls, value: timedelta | None, info: ValidationInfo) -> timedelta | None:
        # The broker's timer counts from the delivery: the batch's wait, the commit and the
        # settle come on top of the handler's time.
        hard = info.data.get("hard_timeout")
        if value is not None and hard is not None and value < hard + ACK_TIMEOUT_MARGIN:
            raise ValueError(
                f"must be at least CONSUMER_HARD_TIMEOUT ({format_duration(hard)}) plus "
                f"{format_duration(ACK_TIMEOUT_MARGIN)}"
            )
        # Exact (a float's milliseconds would refuse 512.002s).
        if value is not None and value % timedelta(milliseconds=1):
            raise ValueError("must be whole milliseconds")
        return value

    @field_validator("hard_timeout")
    @classmethod
    def _check_hard_timeout(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        soft = info.data.get("handler_timeout")
        if soft is not None and value <= soft:
            raise ValueError(
                f"must be longer than CONSUMER_HANDLER_TIMEOUT ({format_duration(soft)})"
            )
        return value

    @field_validator("receipt_margin")
    @classmethod
    def _check_receipt_margin(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        retention = info.data.get("receipt_retention")
        if retention is not None and value >= retention:
            raise ValueError(
                f"must be shorter than CONSUMER_RECEIPT_RETENTION ({format_duration(retention)})"
            )
        return value

    @field_validator("max_clock_skew")
    @classmethod
    def _check_max_clock_skew(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        margin = info.data.get("receipt_margin")
        if margin is not None and value >= margin:
            raise ValueError(
                f"must be shorter than CONSUMER_RECEIPT_MARGIN ({format_duration(margin)}), "
                "which covers the clocks' difference"
            )
        return value

    @field_validator("receipt_partition")
    @classmethod
    def _check_receipt_partition(cls, value: timedelta, info: ValidationInfo) -> timedelta:
        retention = info.data.get("receipt_retention")
        if value < timedelta(seconds=1) or value.total_seconds() % 1:
            raise ValueError("must be whole seconds, at least 1s")
        if retention is not None and value > retention:
            raise ValueError(
                f"must be no longer than CONSUMER_RECEIPT_RETENTION ({format_duration(retention)})"
            )
        return value

    @property
    def amqp_uses_tls(self) -> bool:
        return urlsplit(split_urls(self.amqp_url.get_secret_value())[0]).scheme == "amqps"

    @property
    def amqp_vhost(self) -> str:
        """The virtual host of ``CONSUMER_AMQP_URL`` (of its first node: every node's is one)."""
        path = urlsplit(split_urls(self.amqp_url.get_secret_value())[0]).path
        return unquote(path[1:]) if len(path) > 1 else "/"

    @property
    def safe_amqp_url(self) -> str:
        return ",".join(redact_url(url) for url in split_urls(self.amqp_url.get_secret_value()))

    @property
    def safe_database_url(self) -> str:
        return redact_url(self.database_url.get_secret_value())

    def describe(self) -> dict[str, Any]:
        """The settings as plain values, fit to log: URLs keep no password."""
        values = self.model_dump()
        values["amqp_url"] = self.safe_amqp_url
        values["database_url"] = self.safe_database_url
        if self.management_url is not None:
            values["management_url"] = redact_url(self.management_url.get_secret_value())
        for key, value in values.items():
            if isinstance(value, timedelta):
                values[key] = format_duration(value)
            elif isinstance(value, Path):
                values[key] = str(value)
            elif isinstance(value, tuple) and value and isinstance(value[0], timedelta):
                values[key] = ",".join(format_duration(item) for item in value)
        return values
