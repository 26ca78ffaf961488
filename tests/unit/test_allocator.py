"""glibc's thresholds set by the service, unless the operator set their own."""

from __future__ import annotations

import platform
import subprocess
import sys

import pytest

from consumer.allocator import keep_frame_buffers_on_heap


@pytest.mark.parametrize(
    "tunable", ["MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES"]
)
def test_an_operators_own_tunables_are_left_alone(tunable: str) -> None:
    assert keep_frame_buffers_on_heap({tunable: "131072"}) is False


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's mallopt")
def test_the_thresholds_are_set_on_glibc() -> None:
    # In a process of its own: the setting is process-wide.
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "from consumer.allocator import keep_frame_buffers_on_heap as k; print(k({}))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "True"
