"""Test a team's handlers with the service's own pipeline: ``consumer.testing``.

Public, like :mod:`consumer`: what is exported here is kept from release to release.

* A throwaway database with the service's migrations and the handler modules' applied:
  :class:`TemplateDatabase` (made once per run) and its :meth:`~TemplateDatabase.copy` (a fresh
  database per test), or :func:`fresh_database` for one.
* A harness that runs the service's real pipeline on the messages a test sends
  (:func:`event`, :class:`Message`) and returns each one's :class:`EventOutcome`: processed,
  duplicate, retried at rung N, dead-lettered with its reason, or poison with its reason.
  In process by default, with no RabbitMQ; with ``CONSUMER_TEST_BROKER=1`` (or pytest's
  ``--consumer-broker``) the same calls publish to a throwaway topology on the real broker and
  the real service consumes them: :func:`harness`.
* A pytest plugin (loaded by the ``pytest11`` entry point when the package is installed) with
  the fixtures ``consumer_handlers``, ``consumer_template``, ``consumer_database`` and
  ``consumer_harness``: :mod:`consumer.testing.plugin`.

A message whose routing key no handler registers is refused at the send (:class:`Unroutable`),
as the broker returns it to its producer: it never reaches the service.

::

    from consumer.testing import event, harness

    async def test_charge(consumer_harness):
        [outcome] = await consumer_harness.send(event("billing.charge", {...}))
        assert outcome.processed

The guide: docs/guide/testing.md.
"""

from consumer.errors import Unroutable
from consumer.testing.database import TemplateDatabase, fresh_database
from consumer.testing.harnesses import Harness, harness
from consumer.testing.messages import Message, event
from consumer.testing.outcomes import EventOutcome, Kind
from consumer.testing.settings import broker_requested, harness_settings
from consumer.testing.tracking import HarnessError

__all__ = [
    "EventOutcome",
    "Harness",
    "HarnessError",
    "Kind",
    "Message",
    "TemplateDatabase",
    "Unroutable",
    "broker_requested",
    "event",
    "fresh_database",
    "harness",
    "harness_settings",
]
