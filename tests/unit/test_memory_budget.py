"""What the prefetch can make the process hold, against the memory it may use."""

from __future__ import annotations

from pathlib import Path

import pytest

from consumer.config.settings import Settings
from consumer.errors import ConfigError
from consumer.service.components import memory_budget
from consumer.service.memory import check_memory_budget, container_memory_limit, worst_case

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
