"""The pytest plugin of :mod:`consumer.testing`, loaded by the ``pytest11`` entry point wherever
the service is installed beside pytest.

Fixtures (all named ``consumer_*``):

``consumer_handlers`` (session)
    The handler modules under test: the ``consumer_handlers`` ini option, else
    ``CONSUMER_HANDLERS``. Override it in a ``conftest.py`` to name them in code.
``consumer_template`` (``consumer_databases``, session, keeps it and its copies)
    A :class:`~consumer.testing.TemplateDatabase` with the service's and the handlers'
    migrations, made once per test run (per xdist worker, and per set of handler modules)
    and dropped at its end.
``consumer_database`` (function)
    The URL of a fresh copy of the template, dropped after the test.
``consumer_settings`` (function)
    Settings for the harness by field name (``{"retry_delays": ("1s", "5s")}``); empty unless
    overridden. The environment's ``CONSUMER_*`` apply beneath them, as in production.
``consumer_harness`` (function, async: needs pytest-asyncio)
    A harness on ``consumer_database``: in process, or on the real broker with
    ``--consumer-broker`` or ``CONSUMER_TEST_BROKER=1`` (:func:`consumer.testing.harness`).

The database fixtures are synchronous (their work runs on an event loop of its own, in a
thread: :class:`DatabaseKeeper`), so they fit any event loop scope the tests use; the next
test's database is made while a test runs, and the used ones are dropped behind the tests.
"""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import AsyncIterator, Coroutine, Iterator
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, TypeVar

import pytest

if TYPE_CHECKING:  # imported when a fixture is used: pytest starts fast in every project
    from consumer.testing.database import TemplateDatabase
    from consumer.testing.harnesses import Harness

__all__ = [
    "DatabaseKeeper",
    "DatabaseKeepers",
    "consumer_database",
    "consumer_handlers",
    "consumer_settings",
    "consumer_template",
    "pytest_addoption",
    "pytest_load_initial_conftests",
]

T = TypeVar("T")


_SERVICE_PACKAGES = frozenset({"consumer", "topology"})


@pytest.hookimpl(tryfirst=True)
def pytest_load_initial_conftests(early_config: pytest.Config) -> None:
    """Leave the service's own modules as they are. pytest rewrites the asserts of every
    package of a distribution that declares a plugin: here the whole service, each time a test
    run imports it (about half the run's CPU for a team's handler tests where bytecode is not
    cached, as with PYTHONDONTWRITEBYTECODE). The service's asserts are not tests'. Done through
    the rewrite hook's private set; a pytest without it keeps its default."""
    for finder in sys.meta_path:
        if type(finder).__name__ != "AssertionRewritingHook":
            continue
        marked = getattr(finder, "_must_rewrite", None)
        cache = getattr(finder, "_marked_for_rewrite_cache", None)
        if isinstance(marked, set) and isinstance(cache, dict):
            marked.difference_update(_SERVICE_PACKAGES)
            cache.clear()


def pytest_addoption(parser: pytest.Parser) -> None:
    group = parser.getgroup("consumer", "rabbit-pg-consumer's test kit (consumer.testing)")
    group.addoption(
        "--consumer-broker",
        action="store_true",
        default=False,
        help="run consumer_harness on the real RabbitMQ (also CONSUMER_TEST_BROKER=1)",
    )
    parser.addini(
        "consumer_handlers",
        type="linelist",
        default=[],
        help="the handler modules consumer.testing's fixtures load (default: CONSUMER_HANDLERS)",
    )


class DatabaseKeeper:
    """The run's template and its copies, made on an event loop of its own in a thread, so that
    they fit whatever loop the tests use. The copies the next tests will want are made while a
    test runs (``ahead`` of them at a time), and the used ones are dropped behind the tests: a
    test waits for neither, only for its own copy if it is not ready yet. Everything left is
    dropped at :meth:`close`."""

    def __init__(self, template: TemplateDatabase, *, ahead: int = 2) -> None:
        self.template = template
        self._ahead = ahead
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(
            target=self._loop.run_forever, name="consumer-testing-databases", daemon=True
        )
        self._thread.start()
        self._ready: list[Future[str]] = []
        self._drops: list[Future[None]] = []

    def _submit(self, work: Coroutine[Any, Any, T]) -> Future[T]:
        return asyncio.run_coroutine_threadsafe(work, self._loop)

    def open(self) -> None:
        self._submit(self.template.__aenter__()).result()

    def take(self, wanted_after: int = 0) -> str:
        """A fresh copy's URL; copies for the ``wanted_after`` tests that follow are begun."""
        if not self._ready:
            self._ready.append(self._submit(self.template.new_copy()))
        ready = self._ready.pop(0)
        while len(self._ready) < min(wanted_after, self._ahead):
            self._ready.append(self._submit(self.template.new_copy()))
        return ready.result()

    def give_back(self, url: str) -> None:
        """Drop the copy, behind the tests."""
        self._drops.append(self._submit(self.template.drop_copy(url)))

    def close(self) -> None:
        try:
            for unused in self._ready:
                self.give_back(unused.result())
            self._ready.clear()
            self._drops.append(self._submit(self.template.__aexit__(None, None, None)))
            for drop in self._drops:
                drop.result()
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join()
            self._loop.close()


def _tests_after(request: pytest.FixtureRequest, fixture: str) -> int:
    """How many of the session's tests after this one use ``fixture``."""
    items = request.session.items
    try:
        index = items.index(request.node)
    except ValueError:
        return 0
    return sum(1 for item in items[index + 1 :] if fixture in getattr(item, "fixturenames", ()))


@pytest.fixture(scope="session")
def consumer_handlers(pytestconfig: pytest.Config) -> list[str]:
    """The handler modules under test (see the module docstring)."""
    named = [str(line) for line in pytestconfig.getini("consumer_handlers")]
    if not named:
        named = [m.strip() for m in os.environ.get("CONSUMER_HANDLERS", "").split(",")]
    named = [module for module in named if module]
    if not named:
        raise pytest.UsageError(
            "consumer.testing: name the handler modules to test: the consumer_handlers ini "
            "option, CONSUMER_HANDLERS, or a consumer_handlers fixture in conftest.py"
        )
    return named


class DatabaseKeepers:
    """A :class:`DatabaseKeeper` per set of handler modules, made when first wanted: a test
    module may name handlers of its own (its ``consumer_handlers`` fixture)."""

    def __init__(self) -> None:
        self._keepers: dict[tuple[str, ...], DatabaseKeeper] = {}

    def for_handlers(self, handlers: list[str]) -> DatabaseKeeper:
        key = tuple(handlers)
        keeper = self._keepers.get(key)
        if keeper is None:
            from consumer.testing.database import TemplateDatabase

            keeper = DatabaseKeeper(TemplateDatabase(handlers))
            keeper.open()
            self._keepers[key] = keeper
        return keeper

    def close(self) -> None:
        keepers, self._keepers = list(self._keepers.values()), {}
        for keeper in keepers:
            keeper.close()


@pytest.fixture(scope="session")
def consumer_databases() -> Iterator[DatabaseKeepers]:
    """The run's templates and their copies, one template per set of handler modules."""
    keepers = DatabaseKeepers()
    try:
        yield keepers
    finally:
        keepers.close()


@pytest.fixture
def consumer_template(
    consumer_databases: DatabaseKeepers, consumer_handlers: list[str]
) -> TemplateDatabase:
    """The migrated template database of the run, for the test's handler modules."""
    return consumer_databases.for_handlers(consumer_handlers).template


@pytest.fixture
def consumer_database(
    request: pytest.FixtureRequest,
    consumer_databases: DatabaseKeepers,
    consumer_handlers: list[str],
) -> Iterator[str]:
    """The URL of a fresh copy of the template, dropped after the test."""
    keeper = consumer_databases.for_handlers(consumer_handlers)
    url = keeper.take(wanted_after=_tests_after(request, "consumer_database"))
    try:
        yield url
    finally:
        keeper.give_back(url)


@pytest.fixture
def consumer_settings() -> dict[str, Any]:
    """Settings for the harness by field name; override to change them."""
    return {}


def _broker(config: pytest.Config) -> bool:
    from consumer.testing.settings import broker_requested

    return bool(config.getoption("consumer_broker")) or broker_requested()


try:
    import pytest_asyncio
except ImportError:  # the harness fixture needs it; the database fixtures do not
    pass
else:

    @pytest_asyncio.fixture
    async def consumer_harness(
        request: pytest.FixtureRequest,
        consumer_handlers: list[str],
        consumer_database: str,
        consumer_settings: dict[str, Any],
    ) -> AsyncIterator[Harness]:
        """A harness on the test's database (see the module docstring)."""
        from consumer.testing.harnesses import harness

        async with harness(
            consumer_handlers,
            consumer_database,
            broker=_broker(request.config),
            **consumer_settings,
        ) as running:
            yield running

    __all__ += ["consumer_harness"]
