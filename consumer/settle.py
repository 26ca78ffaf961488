"""The one place that turns a verdict into broker actions.

- Applied: ack (the commit has already returned).
- Rejected (poison): nack without requeue; the work queue dead-letters it through the DLX. Poison
  from an exception a validator raised is published to the DLX instead, with the exception's
  class in its headers (a nack cannot carry it), then acked.
- Failed -> Retry: publish a copy to the rung, wait for the confirm, then ack.
- Failed -> DeadLetter: publish a copy to the DLX with reason headers, wait for the confirm, ack.
- Failed -> Return: nack with requeue, no attempt counted (the service itself holds such
  deliveries through a database outage instead, and returns them only if it stops).
- A publish the broker does not confirm: wait a second, then nack with requeue. Never lost.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Coroutine
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from consumer.delivery import ChannelGone, Delivery
from consumer.errors import PublishFailed, error_name
from consumer.headers import dead_letter_headers, retry_headers
from consumer.outcome import Applied, Failed, Outcome, OutcomeKind, Rejected
from consumer.publisher import Publisher, copy_properties
from consumer.retry import DeadLetter, Retry, jittered_expiration, rung_label
from topology.names import Names


@dataclass(frozen=True, slots=True)
class Settled:
    """The label the delivery ends with, and whether its ack or nack reached the broker."""

    kind: OutcomeKind
    channel_gone: bool = False
    publish_error: PublishFailed | None = None


class Settler:
    """Maps each :class:`Outcome` to exactly one broker action (see the module's table)."""

    def __init__(
        self,
        *,
        names: Names,
        publisher: Publisher,
        jitter: float = 0.0,
        rng: random.Random | None = None,
        publish_failure_pause: float = 1.0,
    ) -> None:
        self._names = names
        self._publisher = publisher
        self._jitter = jitter
        self._publish_failure_pause = publish_failure_pause
        self._rng = rng or random.Random()

    async def settle(self, outcome: Outcome) -> Settled:
        delivery, verdict = outcome.delivery, outcome.verdict
        if isinstance(verdict, Applied):
            return settle_applied(delivery, verdict)
        try:
            if isinstance(verdict, Rejected):
                if verdict.poison.error_class is None:
                    await delivery.nack(requeue=False)
                    return Settled(OutcomeKind.POISON)
                return await self._republished(
                    delivery, self._publish_poison(delivery, verdict), OutcomeKind.POISON
                )
            return await self._settle_failure(delivery, verdict)
        except ChannelGone:
            return Settled(label_for(verdict), channel_gone=True)

    async def _settle_failure(self, delivery: Delivery, failed: Failed) -> Settled:
        decision = failed.decision
        if isinstance(decision, Retry):
            return await self._republished(
                delivery, self._publish_retry(delivery, failed, decision), OutcomeKind.RETRIED
            )
        if isinstance(decision, DeadLetter):
            publish = self._publish_dead_letter(delivery, failed, decision)
            return await self._republished(delivery, publish, OutcomeKind.DEAD_LETTERED)
        await delivery.nack(requeue=True)
        return Settled(OutcomeKind.RETURNED)

    async def _republished(
        self, delivery: Delivery, publish: Coroutine[Any, Any, None], kind: OutcomeKind
    ) -> Settled:
        """Publish a copy (``publish``), wait for its confirm, then ack the original."""
        if not delivery.channel_open:
            publish.close()
            # The broker has the original back already; a copy now would be a second one.
            raise ChannelGone("the delivery's channel closed before its failure was settled")
        try:
            await publish
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

    async def _publish_poison(self, delivery: Delivery, rejected: Rejected) -> None:
        poison = rejected.poison
        headers = dead_letter_headers(
            delivery.headers,
            reason=poison.reason.value,
            attempts=0,
            error_class=poison.error_class or poison.reason.value,
            error_message=poison.detail,
            original_exchange=delivery.exchange,
            original_routing_key=delivery.routing_key,
            service=self._names.service,
            now=datetime.now(UTC),
        )
        properties = copy_properties(delivery.properties, headers=headers)
        await self._publisher.publish(
            delivery.body, properties, exchange=self._names.dlx, routing_key=delivery.routing_key
        )

    async def _publish_retry(self, delivery: Delivery, failed: Failed, retry: Retry) -> None:
        rung = rung_label(retry.delay)
        headers = retry_headers(
            delivery.headers,
            attempt=retry.attempt,
            rung=rung,
            error_class=error_name(failed.error),
            error_message=str(failed.error),
            original_exchange=delivery.exchange,
            original_routing_key=delivery.routing_key,
            now=datetime.now(UTC),
        )
        expiration = jittered_expiration(retry.delay, self._jitter, self._rng)
        properties = copy_properties(delivery.properties, headers=headers, expiration=expiration)
        await self._publisher.publish(
            delivery.body, properties, exchange=self._names.retry, routing_key=delivery.routing_key
        )

    async def _publish_dead_letter(
        self, delivery: Delivery, failed: Failed, dead: DeadLetter
    ) -> None:
        headers = dead_letter_headers(
            delivery.headers,
            reason=dead.reason.value,
            attempts=failed.attempts_so_far,
            error_class=error_name(failed.error),
            error_message=str(failed.error),
            original_exchange=delivery.exchange,
            original_routing_key=delivery.routing_key,
            service=self._names.service,
            now=datetime.now(UTC),
        )
        properties = copy_properties(delivery.properties, headers=headers)
        await self._publisher.publish(
            delivery.body, properties, exchange=self._names.dlx, routing_key=delivery.routing_key
        )


def settle_applied(delivery: Delivery, verdict: Applied) -> Settled:
    """Ack a committed delivery. Synchronous: the ack joins the channel's next flush."""
    kind = OutcomeKind.DUPLICATE if verdict.duplicate else OutcomeKind.PROCESSED
    try:
        delivery.ack()
    except ChannelGone:
        return Settled(kind, channel_gone=True)
    return Settled(kind)


def label_for(verdict: Applied | Rejected | Failed) -> OutcomeKind:
    if isinstance(verdict, Applied):
        return OutcomeKind.DUPLICATE if verdict.duplicate else OutcomeKind.PROCESSED
    if isinstance(verdict, Rejected):
        return OutcomeKind.POISON
    return OutcomeKind.RETURNED
