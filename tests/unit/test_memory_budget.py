"""What the prefetch can make the process hold, against the memory it may use."""

from __future__ import annotations

import gc
import struct
import tracemalloc
from pathlib import Path

import pytest

from consumer.amqp.field_table import (
    MAX_HEADER_ENTRIES,
    UNREADABLE_KEY,
    TableDecoder,
    TableLimits,
)
from consumer.config.settings import Settings
from consumer.errors import ConfigError
from consumer.service.components import memory_budget
from consumer.service.memory import (
    BASE_BYTES,
    check_memory_budget,
    check_queue_budgets,
    container_memory_limit,
    header_bytes,
    worst_case,
    worst_case_of_queues,
)

MIB = 1024 * 1024


def test_the_defaults_fit_the_shipped_kubernetes_limit_of_512_mib() -> None:
    assert worst_case(memory_budget(Settings())) < 512 * MIB
    check_memory_budget(memory_budget(Settings()), container=512 * MIB)


def test_too_much_prefetch_for_the_limit_stops_start_up_naming_the_settings() -> None:
    settings = Settings(prefetch=2000, max_body_bytes=MIB)
    with pytest.raises(ConfigError) as refused:
        check_memory_budget(memory_budget(settings), container=512 * MIB)
    message = str(refused.value)
    assert "CONSUMER_PREFETCH (2000)" in message
    assert "CONSUMER_MAX_BODY_BYTES (1048576)" in message
    assert "512 MiB" in message


def test_the_limit_is_the_setting_else_the_containers_else_none(tmp_path: Path) -> None:
    v2 = tmp_path / "memory.max"
    v2.write_text("536870912\n")
    assert container_memory_limit((v2,)) == 512 * MIB
    v2.write_text("max\n")
    assert container_memory_limit((v2,)) is None
    v1 = tmp_path / "limit_in_bytes"
    v1.write_text(str(1 << 62))
    assert container_memory_limit((tmp_path / "absent", v1)) is None
    with pytest.raises(ConfigError):
        check_memory_budget(memory_budget(Settings(prefetch=60000, memory_limit="512MiB")))


def test_the_worst_case_at_the_defaults_is_the_docs_451_mib() -> None:
    # 96 MiB + 400 x 256 KiB held + 400 x 8 KiB x 20 parsed while held + 4 workers (the most the
    # service runs: the pool) x 1 MiB x 20
    # + 400 x (2 x 64 KiB + 1,024 x 160 B) of headers (docs/operations/security.md)
    budget = memory_budget(Settings())
    assert (budget.prefetch, budget.max_body_bytes, budget.workers) == (400, 256 * 1024, 4)
    assert header_bytes(budget.max_header_bytes) == 288 * 1024
    assert worst_case(budget) == 451 * MIB


def test_the_headers_setting_counts_and_is_named_when_it_does_not_fit() -> None:
    wide = Settings(max_header_bytes=1024 * 1024)
    assert worst_case(memory_budget(wide)) - worst_case(memory_budget(Settings())) == 400 * 2 * (
        1024 * 1024 - 64 * 1024
    )
    with pytest.raises(ConfigError) as refused:
        check_memory_budget(memory_budget(wide), container=512 * MIB)
    assert "CONSUMER_MAX_HEADER_BYTES (1048576)" in str(refused.value)


def _table(entries: bytes) -> bytes:
    return struct.pack(">I", len(entries)) + entries


def _entry(key: bytes, value: bytes) -> bytes:
    return bytes([len(key)]) + key + value


def _costliest_tables(limit: int) -> dict[str, bytes]:
    """Headers within ``limit`` bytes and 1,024 entries that decode to the most Python objects
    for their size: strings that are not UTF-8 (each byte a replacement character), empty tables
    (an entry of 7 bytes a dict), decimals in an array."""
    count = MAX_HEADER_ENTRIES - 1
    length = (limit - 4) // count - 11
    not_utf8 = b"".join(
        _entry(b"k%04d" % n, b"S" + struct.pack(">I", length) + b"\xff" * length)
        for n in range(count)
    )
    empty_tables = b"".join(_entry(b"k%04d" % n, b"F" + struct.pack(">I", 0)) for n in range(count))
    decimals = (b"D" + struct.pack(">Bi", 2, 12345)) * count
    return {
        "not utf-8": _table(not_utf8),
        "empty tables": _table(empty_tables),
        "decimals": _table(_entry(b"a", b"A" + struct.pack(">I", len(decimals)) + decimals)),
    }


@pytest.mark.parametrize("name", ["not utf-8", "empty tables", "decimals"])
def test_a_held_deliverys_headers_decode_within_their_share_of_the_budget(name: str) -> None:
    # Given headers at the default limits built to cost the most once decoded
    limits = TableLimits()
    raw = _costliest_tables(limits.max_bytes)[name]
    assert len(raw) <= limits.max_bytes
    decoder = TableDecoder(limits)

    # When ten copies are decoded and kept
    gc.collect()
    tracemalloc.start()
    try:
        kept = [decoder.table(raw)[1] for _ in range(10)]
        held, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()

    # Then each was decoded (not refused) and takes no more than the budget counts for it
    assert all(UNREADABLE_KEY not in table for table in kept)
    assert held / 10 <= header_bytes(limits.max_bytes)


def test_a_queue_table_s_queues_count_together_the_process_once() -> None:
    # Given two queues that each fit 512 MiB alone, at the default prefetch of 400
    one = memory_budget(Settings())
    both = {"sms": one, "order": one}
    assert worst_case_of_queues(both.values()) == 2 * worst_case(one) - BASE_BYTES

    # Then together they are refused, naming the queues; one of them alone is not
    with pytest.raises(ConfigError) as refused:
        check_queue_budgets(both, container=512 * MIB)
    message = str(refused.value)
    assert message.startswith("the queues sms, order together could take ")
    assert "the container's limit (512 MiB)" in message
    check_queue_budgets({"sms": one}, container=512 * MIB)
    check_queue_budgets(both, container=1024 * MIB)
