"""A handler that meets a table or column that is not there (yet): handler code deployed before
its migration. Transient (the ladder waits for the migration), and counted under its type."""

from __future__ import annotations

import asyncpg
import pytest

from consumer.classification import ErrorKind, classify, schema_missing
from consumer.observe.metrics import Metrics, ServiceRegistry


@pytest.mark.parametrize(
    "error",
    [
        asyncpg.UndefinedTableError('relation "charges" does not exist'),
        asyncpg.UndefinedColumnError('column "currency" does not exist'),
    ],
)
def test_an_undefined_table_or_column_is_transient_and_named_so(error: Exception) -> None:
    assert classify(error) is ErrorKind.TRANSIENT
    assert schema_missing(error)


def test_other_database_errors_are_not_a_missing_schema() -> None:
    assert not schema_missing(asyncpg.UniqueViolationError("duplicate key"))
    assert classify(asyncpg.UniqueViolationError("duplicate key")) is ErrorKind.PERMANENT


def test_the_counter_is_exported_by_type() -> None:
    metrics = Metrics(ServiceRegistry(), ["billing.charge"])

    metrics.schema_missing.labels(type="billing.charge").inc()

    value = metrics.registry.get_sample_value(
        "consumer_schema_missing_total", {"type": "billing.charge"}
    )
    assert value == 1
