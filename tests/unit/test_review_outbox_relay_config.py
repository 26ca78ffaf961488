"""Found in review of the outbox relay (issue 34), now a regression test.

The defect: a round's publishes were bounded only by three publish timeouts. The relay's session
opens with ``idle_in_transaction_session_timeout`` (60 s by default), and a round sends no
statement while it waits for its confirms: with ``CONSUMER_PUBLISH_TIMEOUT`` at 20 s or more, a
round slow enough (a long key chain on a slow broker) was ended by the server before its mark,
and the next round published the same rows again, and was ended again: no progress, for ever."""

from __future__ import annotations

import pytest

from consumer.registry import HandlerRegistry
from consumer.service.components import idle_in_transaction_timeout, relay_config
from tests.unit.test_settings import settings


@pytest.mark.parametrize("publish_timeout", ["1s", "10s", "30s", "5m"])
def test_a_round_s_publishes_end_well_before_the_server_ends_its_idle_transaction(
    monkeypatch: pytest.MonkeyPatch, publish_timeout: str
) -> None:
    values = settings(monkeypatch, publish_timeout=publish_timeout)
    registry = HandlerRegistry([])
    config = relay_config(values, registry)
    # with room left for the marks and the commit, each under the statement timeout
    idle = idle_in_transaction_timeout(values, registry)
    assert config.publish_limit <= idle / 2
    assert config.publish_limit <= values.publish_timeout.total_seconds() * 3
