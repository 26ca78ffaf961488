"""The frame reader's CPU per byte of body, with glibc's allocator as it comes and as the service
tunes it (:mod:`consumer.allocator`), each in a fresh process, side by side.

``python -m bench.frame_reader [MiB]`` (default 768: issue 29's attack, 24 bodies of 32 MiB)
feeds that many MiB of body frames of ``frame_max`` (128 KiB) through
:class:`~consumer.amqp.frames.BulkFrameReceiver` in 256 KiB reads, as a socket delivers them, and
prints the CPU seconds each way. No broker: this is the reader's own cost, which the service pays
on every body it reads, kept or discarded.
"""

from __future__ import annotations

import asyncio
import json
import struct
import subprocess
import sys
import time

from consumer.allocator import keep_frame_buffers_on_heap
from consumer.amqp.frames import BulkFrameReceiver

FRAME_MAX = 128 * 1024
READ = 256 * 1024


async def _read(mebibytes: int) -> float:
    payload = b"x" * (FRAME_MAX - 8)
    frame = struct.pack(">BHI", 3, 1, len(payload)) + payload + b"\xce"
    frames = mebibytes * 1024 * 1024 // FRAME_MAX
    reader = asyncio.StreamReader(limit=READ)
    receiver = BulkFrameReceiver(reader)
    receiver.started = True
    per_read = READ // FRAME_MAX
    started = time.process_time()
    for _ in range(frames // per_read):
        reader.feed_data(frame * per_read)
        for _ in range(per_read):
            await receiver.get_frame()
    return time.process_time() - started


def _one(mebibytes: int, tuned: bool) -> dict[str, object]:
    applied = keep_frame_buffers_on_heap({}) if tuned else False
    return {"tuned": applied, "cpu_seconds": asyncio.run(_read(mebibytes))}


def main(argv: list[str]) -> None:
    if argv[:1] == ["--one"]:
        print(json.dumps(_one(int(argv[1]), argv[2] == "tuned")))
        return
    mebibytes = int(argv[0]) if argv else 768
    for mode in ("default", "tuned"):
        done = subprocess.run(
            [sys.executable, "-m", "bench.frame_reader", "--one", str(mebibytes), mode],
            capture_output=True,
            text=True,
            check=True,
        )
        result = json.loads(done.stdout)
        print(
            f"{mebibytes} MiB of body frames, allocator {mode}"
            f"{'' if result['tuned'] or mode == 'default' else ' (not applied here)'}: "
            f"{result['cpu_seconds']:.2f} CPU-s"
        )


if __name__ == "__main__":
    main(sys.argv[1:])
