"""The one door to the broker: every verdict becomes exactly one action here, and nowhere else.

============  ===============================================================================
APPLIED,      ack (the commit has returned); it joins the channel's next flush
DUPLICATE
POISON        a copy to the DLX with the reason headers (the poison reason; the exception's
              class where a validator raised one), confirmed, then ack: so the letter an
              operator reads carries the service's word, never the producer's ``consumer-*``
              headers (dropped on arrival) nor its ``x-*`` ones. Two exceptions are nacked
              without requeue (the work queue dead-letters the original through the DLX, with
              ``x-death``): a body over the limit (``body_too_large``: dropped unread on the fast
              path, no copy can carry it) and headers over the limit (``headers_too_large``: a copy
              adds the service's own, and a header frame over the broker's ``frame_max`` closes the
              publishing connection, failing every copy in flight on it)
RETRY         a copy to the rung, confirmed, then ack
DEAD_LETTER   a copy to the DLX with the reason headers, confirmed, then ack
HOLD          nothing: the delivery waits for the database (the dispatcher keeps it)
============  ===============================================================================

A copy the broker does not confirm: wait a second, then nack with requeue; never lost. Handing
back a delivery that never started (a shutdown) is a nack with requeue too: :meth:`give_back`.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Any

from consumer.amqp.delivery import Delivery
from consumer.amqp.headers import attempts_so_far, dead_letter_headers, retry_headers
from consumer.amqp.publisher import Publishes, copy_properties
from consumer.error_text import error_name, message_of
from consumer.errors import ChannelGone, Poison, PoisonReason, PublishFailed
from consumer.pipeline.outcome import (
    Failed,
    Outcome,
    OutcomeKind,
    Rejected,
    Settled,
    Verdict,
    VerdictKind,
)
from consumer.pipeline.retry import DeadLetter, Retry, jittered_expiration
from consumer.pipeline.tracing import Tracing, publish_span
from topology.names import Names, rung_label

__all__ = ["Settler"]

_LABELS = {
    VerdictKind.APPLIED: OutcomeKind.PROCESSED,
    VerdictKind.DUPLICATE: OutcomeKind.DUPLICATE,
    VerdictKind.POISON: OutcomeKind.POISON,
    VerdictKind.RETRY: OutcomeKind.RETRIED,
    VerdictKind.DEAD_LETTER: OutcomeKind.DEAD_LETTERED,
}

_ACKED = (VerdictKind.APPLIED, VerdictKind.DUPLICATE)


class Settler:
    """Settles outcomes on the broker; :attr:`publisher` is the current session's (None while
    disconnected, when every settle finds its channel gone)."""

    def __init__(
        self,
        *,
        names: Names,
        jitter: float = 0.0,
        rng: random.Random | None = None,
        publish_failure_pause: float = 1.0,
        tracing: Tracing | None = None,
    ) -> None:
        self._names = names
        self._tracing = tracing or Tracing()
        self._jitter = jitter
        self._publish_failure_pause = publish_failure_pause
        self._rng = rng or random.Random()
        self.publisher: Publishes | None = None

    async def settle(self, outcomes: Sequence[Outcome]) -> list[Settled]:
        """One action per outcome, in their order. Acks go first, at once; copies are published
        concurrently; held ones are left alone."""
        settled: list[Settled | None] = [None] * len(outcomes)
        pending: list[int] = []
        for index, outcome in enumerate(outcomes):
            kind = outcome.verdict.kind
            if kind is VerdictKind.HOLD:
                settled[index] = Settled(None)
            elif kind in _ACKED:
                settled[index] = _ack(outcome.delivery, _LABELS[kind])
            else:
                pending.append(index)
        if pending:
            done = await asyncio.gather(*(self._settle_one(outcomes[i]) for i in pending))
            for index, result in zip(pending, done, strict=True):
                settled[index] = result
        return [result for result in settled if result is not None]

    def acked_now(self, outcomes: Sequence[Outcome]) -> list[Settled] | None:
        """:meth:`settle` when every outcome is an ack (applied or a duplicate), done at once:
        nothing to await, so nothing a shutdown's cancellation could cut short. None, settling
        nothing, when any outcome needs a copy, a nack or holding."""
        for outcome in outcomes:
            if outcome.verdict.kind not in _ACKED:
                return None
        return [_ack(outcome.delivery, _LABELS[outcome.verdict.kind]) for outcome in outcomes]

    async def give_back(self, delivery: Delivery) -> Settled:
        """Return a delivery that never started to the queue (a shutdown)."""
        try:
            await delivery.nack(requeue=True)
        except ChannelGone:
            return Settled(OutcomeKind.RETURNED, channel_gone=True)
        return Settled(OutcomeKind.RETURNED)

    async def _settle_one(self, outcome: Outcome) -> Settled:
        delivery, verdict = outcome.delivery, outcome.verdict
        label = _LABELS[verdict.kind]
        try:
            if isinstance(verdict, Rejected) and not _copyable(verdict.poison):
                await delivery.nack(requeue=False)
                return Settled(label)
            return await self._republished(delivery, verdict, label)
        except ChannelGone:
            return Settled(label, channel_gone=True)

    async def _republished(
        self, delivery: Delivery, verdict: Verdict, kind: OutcomeKind
    ) -> Settled:
        """Publish the copy ``verdict`` asks for, wait for its confirm, then ack the original."""
        if not delivery.channel_open or self.publisher is None:
            # The broker has the original back already; a copy now would be a second one.
            raise ChannelGone("the delivery's channel closed before its failure was settled")
        try:
            await self._publish_copy(delivery, verdict)
        except PublishFailed as error:
            # Holding the original a moment keeps a broker that refuses publishes from turning
            # the redelivery into a hot loop that burns through the delivery limit.
            await asyncio.sleep(self._publish_failure_pause)
            await delivery.nack(requeue=True)
            return Settled(OutcomeKind.RETURNED, publish_error=error)
        try:
            delivery.ack()
        except ChannelGone:
            # The copy is out; the original comes back and will be copied again (a second copy,
            # no second effect). Count what happened to this one.
            return Settled(kind, channel_gone=True)
        return Settled(kind)

    async def _publish_copy(self, delivery: Delivery, verdict: Verdict) -> None:
        if isinstance(verdict, Rejected):
            await self._publish_poison(delivery, verdict)
            return
        assert isinstance(verdict, Failed)
        if isinstance(verdict.decision, Retry):
            await self._publish_retry(delivery, verdict, verdict.decision)
            return
        assert isinstance(verdict.decision, DeadLetter)
        await self._publish_dead_letter(delivery, verdict, verdict.decision)

    async def _publish(self, delivery: Delivery, headers: dict[str, Any], exchange: str) -> None:
        await self._published(
            delivery, copy_properties(delivery.properties, headers=headers), exchange
        )

    async def _published(self, delivery: Delivery, properties: Any, exchange: str) -> None:
        assert self.publisher is not None
        # The copy carries on the trace from this delivery's span (its traceparent replaced).
        with publish_span(
            self._tracing,
            properties,
            exchange=exchange,
            routing_key=delivery.routing_key,
            parent=self._tracing.span_of(delivery),
        ):
            await self.publisher.publish(
                delivery.body, properties, exchange=exchange, routing_key=delivery.routing_key
            )

    async def _publish_poison(self, delivery: Delivery, rejected: Rejected) -> None:
        poison = rejected.poison
        headers = dead_letter_headers(
            delivery.headers,
            reason=poison.reason.value,
            attempts=attempts_so_far(delivery.headers),
            error_class=poison.error_class or poison.reason.value,
            error_message=poison.detail,
            original_exchange=delivery.exchange,
            original_routing_key=delivery.routing_key,
            service=self._names.service,
            now=datetime.now(UTC),
            queue=self._names.queue,
        )
        await self._publish(delivery, headers, self._names.dlx)

    async def _publish_retry(self, delivery: Delivery, failed: Failed, retry: Retry) -> None:
        headers = retry_headers(
            delivery.headers,
            attempt=retry.attempt,
            rung=rung_label(retry.delay),
            error_class=error_name(failed.error),
            error_message=message_of(failed.error),
            original_exchange=delivery.exchange,
            original_routing_key=delivery.routing_key,
            now=datetime.now(UTC),
        )
        expiration = jittered_expiration(retry.delay, self._jitter, self._rng)
        properties = copy_properties(delivery.properties, headers=headers, expiration=expiration)
        await self._published(delivery, properties, self._names.retry)

    async def _publish_dead_letter(
        self, delivery: Delivery, failed: Failed, dead: DeadLetter
    ) -> None:
        headers = dead_letter_headers(
            delivery.headers,
            reason=dead.reason.value,
            attempts=failed.attempts_so_far,
            error_class=error_name(failed.error),
            error_message=message_of(failed.error),
            original_exchange=delivery.exchange,
            original_routing_key=delivery.routing_key,
            service=self._names.service,
            now=datetime.now(UTC),
            queue=self._names.queue,
        )
        await self._publish(delivery, headers, self._names.dlx)


def _copyable(poison: Poison) -> bool:
    """Whether poison is dead-lettered as a copy of the service's own (see the module docstring
    for the two that cannot be). A body over the limit is nacked whether the fast path dropped it
    unread or aiormq's own code read it whole (``CONSUMER_AMQP_FAST_PATH=false``): the same
    letter either way."""
    return poison.reason not in (PoisonReason.BODY_TOO_LARGE, PoisonReason.HEADERS_TOO_LARGE)


def _ack(delivery: Delivery, kind: OutcomeKind) -> Settled:
    """Ack a committed delivery. Synchronous: the ack joins the channel's next flush."""
    try:
        delivery.ack()
    except ChannelGone:
        return Settled(kind, channel_gone=True)
    return Settled(kind)
