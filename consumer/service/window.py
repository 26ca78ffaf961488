"""How full the prefetch window is: the deliveries received on the current consume channel and
not yet settled, against ``CONSUMER_PREFETCH``. While it is full the broker sends nothing more
until one is settled, so no batch should wait for another delivery (:mod:`consumer.service.inbox`).

The supervisor tells it the session it consumes on (none while disconnected); the dispatcher and
the ``consumer_in_flight`` gauge read it.
"""

from __future__ import annotations

from typing import Protocol

__all__ = ["PrefetchWindow"]


class _Session(Protocol):
    @property
    def unsettled(self) -> int: ...


class PrefetchWindow:
    """The window of one process's consume channel, across its reconnects."""

    def __init__(self, prefetch: int) -> None:
        self.prefetch = prefetch
        self.session: _Session | None = None
        """The session consuming now; None while disconnected (nothing in flight then)."""

    def in_flight(self) -> int:
        session = self.session
        return session.unsettled if session is not None else 0

    def full(self) -> bool:
        return self.in_flight() >= self.prefetch
