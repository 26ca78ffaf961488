"""glibc's allocator told to keep frame-sized buffers on its heap.

Every frame the service reads allocates and frees buffers of up to a socket read (256 KiB) and a
frame (``frame_max``, 128 KiB). glibc's defaults serve blocks that large by ``mmap``, or from a
heap top it trims again as soon as twice that is free, so each one comes as fresh pages the kernel
must zero and map. That is most of what reading a body costs: discarding issue 29's 768 MiB of
oversized bodies took 1.15 CPU-seconds in the frame reader at glibc's defaults and 0.38 with the
thresholds below (measured by bench/frame_reader.py). The heap then keeps at
most :data:`TRIM_THRESHOLD` free at its top: a few MiB of RSS, against the hundreds of the memory
budget.

An operator's own ``MALLOC_*`` tunables (glibc reads them at start) win: nothing is changed then.
Elsewhere than glibc (musl, macOS) there is nothing to do.
"""

from __future__ import annotations

import ctypes
import os
from collections.abc import Mapping

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_frame_buffers_on_heap"]

MMAP_THRESHOLD = 1024 * 1024
"""Blocks below this come from the heap (glibc's ``M_MMAP_THRESHOLD``; its default is 128 KiB,
adjusted upwards as blocks are freed)."""
TRIM_THRESHOLD = 4 * MMAP_THRESHOLD
"""Free memory at the heap's top kept rather than given back (``M_TRIM_THRESHOLD``)."""

_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
_OPERATOR_TUNABLES = ("MALLOC_MMAP_THRESHOLD_", "MALLOC_TRIM_THRESHOLD_", "GLIBC_TUNABLES")


def keep_frame_buffers_on_heap(environ: Mapping[str, str] = os.environ) -> bool:
    """Set glibc's thresholds (module docstring); whether they were set. Process-wide, so called
    once, by the command that runs the service."""
    if any(name in environ for name in _OPERATOR_TUNABLES):
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    # mallopt returns 1 on success; musl's stub returns 0 and changes nothing.
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
