"""The handler modules under test, for consumer.testing's fixtures (consumer_harness...)."""

import pytest


@pytest.fixture(scope="session")
def consumer_handlers() -> list[str]:
    return ["billing.handlers"]
