"""Apply RabbitMQ events to PostgreSQL exactly once.

Handler authors need only what is exported here::

    from consumer import Envelope, PermanentError, TransientError, register

    @register("inventory.restock", payload=Restock)
    async def restock(event: Envelope[Restock], conn: Connection) -> None: ...

``register_batch`` marks a handler that applies a whole batch of events in a few statements.
``await event.publish(type, payload)`` writes a follow-up event to the outbox in the handler's
transaction; code that is not a handler does the same with :func:`consumer.outbox.enqueue`,
public too (as is :class:`consumer.errors.OutboxMisuse`, which it raises).

Everything else in this package is internal and may change in any release: the wings
(``config``, ``amqp``, ``db``, ``pipeline``, ``observe``, ``service``, ``cli``) and the modules
beside this one. No module there says so again. The command line (``consumer --help``), the
settings (``CONSUMER_*``), the metrics, the log lines' fields, the SQL tables and the headers on
dead letters are the rest of the public surface.
"""

from consumer.envelope import Envelope
from consumer.errors import HandlerTimeout, PermanentError, TransientError
from consumer.registry import Connection, register, register_batch
from consumer.version import __version__

__all__ = [
    "Connection",
    "Envelope",
    "HandlerTimeout",
    "PermanentError",
    "TransientError",
    "__version__",
    "register",
    "register_batch",
]
