"""Every error the service raises or classifies, in one tree.

::

    ConsumerError
    ├── ConfigError            a bad setting or handler module; start-up stops (exit 2)
    │   ├── IncompatibleLibrary  an installed library does not behave as the service relies on
    │   ├── BrokerUnsupported  the broker's version lacks what the plan sets (x-consumer-timeout)
    │   └── QueueTableError  the queue table (``CONSUMER_QUEUES_FILE``) is unusable
    ├── TopologyError          the broker's queues and exchanges are not what the service needs
    │   ├── TopologyMissing    something is not declared: run ``consumer topology apply``
    │   └── TopologyConflict   something exists with other arguments; nothing was changed
    ├── MigrationError         a migration cannot be applied (an applied file was edited...)
    ├── HandlerError           what handlers raise to say how an event failed
    │   ├── TransientError     waiting may fix it: the event climbs the retry ladder
    │   │   └── HandlerTimeout the handler ran past its soft time limit and was cancelled
    │   └── PermanentError     no retry can fix it: the event is dead-lettered at once
    │       ├── SwallowedDatabaseError   the handler caught a database error and went on
    │       ├── HandlerEndedTransaction  the handler committed or rolled back the transaction
    │       ├── BatchResultError         a batch handler's answer did not fit its events
    │       ├── HardTimeLimitExceeded    it blocked the event loop past the hard time limit
    │       ├── CrashedRepeatedly        processes died while it was being applied isolated
    │       ├── ConnectionLostRepeatedly its database connection broke each time it was applied
    │       ├── EventExpired             its receipts' range was dropped: too old to apply
    │       ├── IdConflict               its id is that of an event of another type applied
    │       └── InvalidPublish           its handler published an event its type's model refuses
    ├── DatabaseUnavailable    the database cannot be reached: pause, count no attempt
    │   └── DatabaseStalled    it stopped answering the service's own statement in time
    ├── PipelineFault          the service itself cannot work (no receipts table): it stops
    ├── BrokerUnreachable      RabbitMQ refused or did not answer (also a ConnectionError)
    │   └── BrokerRejected     it answered, but rejects the credentials or certificate
    ├── ConnectionLost         a session's connection or channel closed: reconnect
    ├── ChannelGone            a delivery's channel is closed: its tag means nothing any more
    ├── OutboxMisuse           an outbox row asked for that cannot be written as asked
    ├── Poison                 a message that can never be processed, with its reason
    └── PublishFailed          the broker did not confirm a publish: return the original
        └── Unroutable         no queue is bound for the routing key

What an exception raised while applying an event means (transient, permanent, the database
away) is decided by type, never by message text, in :mod:`consumer.classification`.
"""

from __future__ import annotations

import enum

from consumer.error_text import error_name, message_of

__all__ = [
    "BatchResultError",
    "BrokerRejected",
    "BrokerUnreachable",
    "BrokerUnsupported",
    "ChannelGone",
    "ClockSkewed",
    "ConfigError",
    "ConnectionLost",
    "ConnectionLostRepeatedly",
    "ConsumerError",
    "CrashedRepeatedly",
    "DatabaseStalled",
    "DatabaseUnavailable",
    "EventExpired",
    "HandlerEndedTransaction",
    "HandlerError",
    "HandlerRaisedBaseException",
    "HandlerTimeout",
    "HardTimeLimitExceeded",
    "IdConflict",
    "IncompatibleLibrary",
    "InvalidPublish",
    "MigrationError",
    "OutboxMisuse",
    "PermanentError",
    "PipelineFault",
    "Poison",
    "PoisonReason",
    "PublishFailed",
    "QueueTableError",
    "SwallowedDatabaseError",
    "TopologyConflict",
    "TopologyError",
    "TopologyMissing",
    "TransientError",
    "Unroutable",
]


class ConsumerError(Exception):
    """Base of every error the service defines."""


class ConfigError(ConsumerError):
    """A setting or handler module is unusable; the message names it."""


class IncompatibleLibrary(ConfigError):
    """An installed library does not behave as the service relies on (a pamqp whose header
    decoders the start-up self-test finds unprotected, :func:`consumer.amqp.wire.self_test`)."""


class BrokerUnsupported(ConfigError):
    """The broker's version lacks what the plan sets (a queue's own acknowledgement timeout on
    RabbitMQ before 3.12, :mod:`topology.broker_support`)."""


class QueueTableError(ConfigError):
    """The queue table (``CONSUMER_QUEUES_FILE``) cannot be used: its message is the one line
    start-up prints, naming the file, the queue and the key."""


class TopologyError(ConsumerError):
    """The broker topology is not what the service needs."""


class TopologyMissing(TopologyError):
    """A queue or exchange the service needs is not declared."""


class TopologyConflict(TopologyError):
    """A queue or exchange exists with arguments other than the plan's."""


class MigrationError(ConsumerError):
    """A migration cannot be applied."""


class HandlerError(ConsumerError):
    """Raised by handlers to say how applying an event failed."""


class TransientError(HandlerError):
    """A failure that waiting may fix (a dependency down, a lock held): retry later."""


class HandlerTimeout(TransientError):
    """The handler ran past its soft time limit: cancelled, its transaction rolled back."""


class PermanentError(HandlerError):
    """A failure no retry can fix (a business rule, bad data): dead-letter at once."""

    reason = "permanent_failure"
    """The dead letter's ``consumer-dead-reason``."""


class SwallowedDatabaseError(PermanentError):
    """The handler caught a database error without a savepoint and returned (or went on).

    PostgreSQL aborts the whole transaction at the first error: nothing written after it, nor the
    receipt, can commit (``COMMIT`` then answers ``ROLLBACK``). The service re-runs the other
    events of the batch and dead-letters this one.
    """

    @classmethod
    def for_handler(cls, handler: str) -> SwallowedDatabaseError:
        return cls(
            f"{handler} caught a database error and went on, which aborts the transaction "
            "(nothing it wrote could commit): let the error propagate, write the statement so "
            "that it cannot fail (INSERT ... ON CONFLICT DO NOTHING), or catch it around a "
            "savepoint: `async with conn.transaction(): ...`"
        )


class HandlerEndedTransaction(PermanentError):
    """The handler ran COMMIT or ROLLBACK on the service's transaction (and perhaps began one of
    its own), or fired the commit check early (``SET CONSTRAINTS ALL IMMEDIATE``)."""

    @classmethod
    def for_handler(cls, handler: str) -> HandlerEndedTransaction:
        return cls(
            f"{handler} ended the service's transaction (COMMIT or ROLLBACK), so its receipt "
            "and its effect no longer commit together: never end the transaction in a handler; "
            "`async with conn.transaction():` gives a savepoint"
        )

    @classmethod
    def constraints_all_immediate(cls, handler: str) -> HandlerEndedTransaction:
        return cls(
            f"{handler} made every deferred constraint immediate (SET CONSTRAINTS ALL "
            "IMMEDIATE), which fires the service's check that receipts commit only with its own "
            "COMMIT: name the constraints instead (SET CONSTRAINTS my_fkey IMMEDIATE)"
        )


class HandlerRaisedBaseException(PermanentError):
    """The handler raised what is not an :class:`Exception` (``CancelledError`` from a future or
    task some library cancelled, ``GeneratorExit``, a library's own ``BaseException``): a handler
    bug, failing its event alone, never the worker that called it."""

    @classmethod
    def for_handler(cls, handler: str, error: BaseException) -> HandlerRaisedBaseException:
        return cls(
            f"{handler} raised {error_name(error)} ({message_of(error)}), which is not an "
            "Exception: raise an Exception (TransientError, PermanentError) to fail an event"
        )


class BatchResultError(PermanentError):
    """A batch handler's answer is not one ``None`` or exception per event (a handler bug)."""


class HardTimeLimitExceeded(PermanentError):
    """The handler blocked the event loop past ``CONSUMER_HARD_TIMEOUT``; the process exited."""

    reason = "hard_time_limit"


class CrashedRepeatedly(PermanentError):
    """Processes died while applying this event isolated, with nothing else in flight."""

    reason = "crashed"


class ConnectionLostRepeatedly(PermanentError):
    """The event's database connection broke every time it was applied isolated, while the database
    answered in between (a backend crash on its payload, a server-side session timeout)."""

    reason = "connection_lost"


class EventExpired(PermanentError):
    """The database refused the event's receipt: its occurred_at falls in a range of receipts
    already dropped (:mod:`consumer.db.retention`), so an earlier copy may have been applied."""

    reason = "expired"


class IdConflict(PermanentError):
    """Its event id and occurred_at are those of an event of another type, already applied (or in
    the same batch): a producer reused, or guessed, another event's id. Not a duplicate, and no
    retry can apply it: dead-lettered with the reason, so that the suppressed event is seen.

    A dead letter, not poison: the message is a valid event, and what makes it fail is what the
    database already holds (the other event may be the forged one); a published dead letter
    carries the service's reason headers, a nack would carry only the producer's."""

    reason = "id_conflict"

    @classmethod
    def between(cls, event_id: object, event_type: str, stored_type: str) -> IdConflict:
        return cls(
            f"event id {event_id} (with this occurred_at) belongs to a {stored_type!r} event "
            f"already applied, not to this {event_type!r} one: two events share an id (ids "
            "must be unguessable: UUIDv4 or v7, never derived from a business id)"
        )


class InvalidPublish(PermanentError):
    """The handler published (``event.publish``) an event that cannot be sent as asked: its type
    is no event type, its payload is not JSON, or the model of the handler this service has for
    that type refuses it. Nothing the handler wrote commits, and the event that caused it is
    dead-lettered: a retry would publish the same payload again."""

    reason = "invalid_publish"


class DatabaseUnavailable(ConsumerError):
    """The database cannot be reached; the service pauses instead of failing events."""


class DatabaseStalled(DatabaseUnavailable):
    """The database stopped answering one of the service's own statements in time (frozen,
    partitioned): the server's state, never the event's doing."""


class PipelineFault(ConsumerError):
    """Something no event can be blamed for is broken (no receipts table, a missing grant): stop."""


class ClockSkewed(PipelineFault):
    """This host's clock and the database's disagree by more than ``CONSUMER_MAX_CLOCK_SKEW``
    (:mod:`consumer.db.clock`): the service does not start."""


class BrokerUnreachable(ConsumerError, ConnectionError):
    """RabbitMQ refused or did not answer; the message names the URL without its password."""


class BrokerRejected(BrokerUnreachable):
    """RabbitMQ answered but the connection cannot work as configured: the broker refused the
    credentials, or its TLS certificate did not verify. Waiting will not fix it."""


class ConnectionLost(ConsumerError, ConnectionError):
    """The broker connection or one of the session's channels closed."""


class ChannelGone(ConsumerError):
    """The channel a delivery came on is closed: its tag means nothing any more.

    The broker has already put the message back in the queue; acking it on another channel would
    ack a different message, so the service never tries.
    """


class OutboxMisuse(ConsumerError):
    """``consumer.outbox.enqueue`` called where its row cannot do what an outbox row promises:
    outside a transaction (the row would commit alone), or with a type that is no event type."""


class PoisonReason(enum.StrEnum):
    """Why a message can never be processed, whatever is retried."""

    BODY_TOO_LARGE = "body_too_large"
    WRONG_CONTENT_TYPE = "wrong_content_type"
    NOT_UTF8 = "not_utf8"
    NOT_JSON = "not_json"
    INVALID_ENVELOPE = "invalid_envelope"
    ROUTING_KEY_MISMATCH = "routing_key_mismatch"
    """Its body's type is not the routing key it was published with: the broker authorised the
    routing key (topic permissions), not the type the service would apply."""
    UNKNOWN_TYPE = "unknown_type"
    INVALID_PAYLOAD = "invalid_payload"
    TOO_DEEP = "too_deep"
    DUPLICATE_KEY = "duplicate_key"
    TOO_COMPLEX = "too_complex"
    HEADERS_TOO_LARGE = "headers_too_large"
    HEADERS_TOO_DEEP = "headers_too_deep"
    HEADERS_UNREADABLE = "headers_unreadable"
    EXPIRED = "expired"
    """Its occurred_at is older than the receipts kept can vouch for (:mod:`consumer.db.retention`):
    applying it could apply it twice."""


class Poison(ConsumerError):
    """A message that can never be processed, with the reason and a short detail for people.

    ``error_class`` names the exception a validator raised where pydantic lets it through
    (anything but ``ValueError`` and ``AssertionError``): such poison is dead-lettered with the
    class in its headers, since a nack could not say it.

    ``body_discarded``: the body was over the limit and dropped as it arrived, unread
    (:mod:`consumer.amqp.direct_consume`). No copy can carry it, so such poison is always settled
    with a nack: the broker dead-letters the original, body and all.

    ``event_type``: the type the body names, when it got as far as naming one (a payload that
    fails its model's validation has one): the line and the metrics say it instead of nothing.
    """

    event_type: str | None = None

    def __init__(
        self,
        reason: PoisonReason,
        detail: str,
        error_class: str | None = None,
        *,
        body_discarded: bool = False,
    ) -> None:
        super().__init__(f"{reason.value}: {detail}")
        self.reason = reason
        self.detail = detail
        self.error_class = error_class
        self.body_discarded = body_discarded


class PublishFailed(ConsumerError):
    """The broker nacked, returned or did not confirm a publish in time."""


class Unroutable(PublishFailed):
    """The broker returned a mandatory publish: no queue is bound for it."""
