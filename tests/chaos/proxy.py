"""A TCP proxy of the chaos suite's own that delays what it forwards (this kernel has no netem):
``python -m tests.chaos.proxy --control FILE --route LISTEN_PORT:HOST:PORT ...``, run on the
network lab's ``proxy`` host between the service and its servers.

Each chunk read from either side goes out ``delay`` ± ``jitter`` milliseconds later (uniform), in
order: a chunk never overtakes the one before it on the same side, as on one TCP stream. The
control file holds ``<delay_ms> <jitter_ms>`` and is read again every 0.2s, so a fault turns the
latency on and off while the connections live (a missing or empty file: no delay).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import random
import time
from pathlib import Path

READ_SIZE = 65536
CONTROL_EVERY = 0.2


class Latency:
    """The delay now in force, from the control file."""

    def __init__(self, control: Path) -> None:
        self._control = control
        self.delay = 0.0
        self.jitter = 0.0

    def read(self) -> None:
        try:
            fields = self._control.read_text().split()
        except OSError:
            fields = []
        delay, jitter = (float(fields[0]), float(fields[1])) if len(fields) == 2 else (0.0, 0.0)
        self.delay, self.jitter = delay / 1000, jitter / 1000

    async def watch(self) -> None:
        while True:
            self.read()
            await asyncio.sleep(CONTROL_EVERY)

    def sample(self) -> float:
        if self.delay <= 0:
            return 0.0
        return max(0.0, random.uniform(self.delay - self.jitter, self.delay + self.jitter))


async def _pipe(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, latency: Latency
) -> None:
    """Forward one direction: each chunk due at its own time, never before the previous one."""
    queue: asyncio.Queue[tuple[float, bytes]] = asyncio.Queue()

    async def send() -> None:
        while True:
            due, chunk = await queue.get()
            if not chunk:
                writer.write_eof()
                return
            wait = due - time.monotonic()
            if wait > 0:
                await asyncio.sleep(wait)
            writer.write(chunk)
            await writer.drain()

    sender = asyncio.create_task(send())
    last = 0.0
    try:
        while True:
            chunk = await reader.read(READ_SIZE)
            last = max(last, time.monotonic() + latency.sample())
            await queue.put((last, chunk))
            if not chunk:
                break
        await sender
    finally:
        sender.cancel()
        with contextlib.suppress(BaseException):
            await sender


async def _serve(listen: int, host: str, port: int, latency: Latency) -> asyncio.Server:
    async def connected(client_r: asyncio.StreamReader, client_w: asyncio.StreamWriter) -> None:
        try:
            server_r, server_w = await asyncio.open_connection(host, port)
        except OSError:
            client_w.close()
            return
        try:
            await asyncio.gather(
                _pipe(client_r, server_w, latency), _pipe(server_r, client_w, latency)
            )
        except (OSError, asyncio.IncompleteReadError):
            pass  # a side went away: the other is closed below
        finally:
            for writer in (client_w, server_w):
                writer.close()

    return await asyncio.start_server(connected, "0.0.0.0", listen)


async def main(routes: list[str], control: Path) -> None:
    latency = Latency(control)
    latency.read()
    watcher = asyncio.create_task(latency.watch())
    servers = []
    for route in routes:
        listen, host, port = route.split(":")
        servers.append(await _serve(int(listen), host, int(port), latency))
    print("proxy listening", flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        watcher.cancel()
        for server in servers:
            server.close()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--route", action="append", required=True, help="LISTEN_PORT:HOST:PORT")
    parser.add_argument("--control", type=Path, required=True)
    arguments = parser.parse_args()
    asyncio.run(main(arguments.route, arguments.control))
