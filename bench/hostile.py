"""``python -m bench.hostile {bodies,headers,decode}``: what a hostile producer costs the service.

- ``bodies``: the service at its defaults, ``--bodies`` messages of ``--body-mib`` MiB each (24 of
  32 MiB: issue 29's out-of-memory attack) published while it runs, with ``--innocents``
  ordinary events after them. The service's RSS is sampled every 0.2 s: at rest, the highest
  sample and after everything is settled, with the kernel's high-water mark (``VmHWM``).
- ``headers``: ``--floods`` messages whose headers are one table of ``--entries`` entries sharing
  one (empty) key, about 120 KB (issue 29's header flood), with ``--innocents`` ordinary events
  published among them. It reports when the last innocent event committed, counted from the
  first publish, and the slowest ``/healthz`` answer while they were processed (asked every
  0.1 s).
- ``decode``: in this process, no broker: the flood's table decoded by pamqp's own decoder (what
  the service used before issue 29), by the decoder :func:`consumer.amqp.wire.install` puts in its
  place, and as a whole content-header frame by the service's fast path
  (:func:`consumer.amqp.frames.decode_frame`); and a small ordinary header table each way.

Each prints its figures; nothing is asserted (the machine is shared: see bench/README.md).
Everything the service scenarios create (names ``bench_<id>_hostile``, their database) is
deleted at the end. :class:`RawTable` and :func:`flood_table` also serve the integration tests.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import struct
import sys
import time
import uuid
from collections.abc import Callable, Iterator, Sequence
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any

import aiohttp
import aiormq
import asyncpg
from pamqp import commands, encode

from bench.events import EVENT_TYPE, Workload, envelope
from bench.events import encode as encode_event
from bench.infra import BenchError, Child, Infra
from bench.measure import owned_env, wait_ready

__all__ = ["RawTable", "flood_table", "forged_tables", "main", "pristine_pamqp_decode"]

RESULTS = Path(__file__).resolve().parent / "results"


class RawTable(dict[str, Any]):
    """Headers that go on the wire as ``raw``, a field table built by hand (within
    :func:`forged_tables`): a hostile producer's duplicate keys and all."""

    def __init__(self, raw: bytes) -> None:
        super().__init__()
        self.raw = raw


def flood_table(entries: int, key: bytes = b"") -> bytes:
    """A field table of ``entries`` entries that all have the key ``key`` and no value (void):
    2 bytes each with the empty key, so 60,000 fill one content-header frame (128 KiB)."""
    entry = bytes([len(key)]) + key + b"V"
    return struct.pack(">I", entries * len(entry)) + entry * entries


@contextlib.contextmanager
def forged_tables() -> Iterator[None]:
    """While open, pamqp's encoder (of this process) writes a :class:`RawTable` as it is."""
    original = encode.METHODS["table"]

    def table(value: Any) -> bytes:
        return value.raw if isinstance(value, RawTable) else original(value)

    encode.METHODS["table"] = table
    try:
        yield
    finally:
        encode.METHODS["table"] = original


def _progress(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


# -- decode: in process --------------------------------------------------------------------------


def pristine_pamqp_decode() -> ModuleType:
    """A private copy of ``pamqp.decode``, untouched by :func:`consumer.amqp.wire.install`: pamqp's
    own decoders, the oracle of the tests and the "before" of the measurements."""
    spec = importlib.util.find_spec("pamqp.decode")
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timed(call: Callable[[], object], repeat: int) -> float:
    """The best of ``repeat`` calls, in milliseconds."""
    best = float("inf")
    for _ in range(repeat):
        started = time.perf_counter()
        call()
        best = min(best, time.perf_counter() - started)
    return best * 1000


def _headers_frame(table: bytes) -> bytes:
    flags = commands.Basic.Properties.flags["headers"]
    payload = struct.pack(">HHQH", 60, 0, 2, flags) + table
    return struct.pack(">BHI", 2, 1, len(payload)) + payload + b"\xce"


def _wide_table(entries: int) -> bytes:
    """``entries`` entries with distinct keys and no value: what only an entry limit refuses."""
    body = b"".join(
        bytes([len(key)]) + key + b"V" for key in (str(n).encode() for n in range(entries))
    )
    return struct.pack(">I", len(body)) + body


def run_decode(entries: int, wide: int, repeat: int) -> dict[str, Any]:
    """Each table decoded by pamqp's own decoder, by what :func:`consumer.amqp.wire.install` put in
    its place (at the default limits), as a whole frame by the fast path, and, for the record, by
    the service's decoder with the limits lifted (what reading it by offset costs)."""
    from consumer.amqp import wire
    from consumer.amqp.field_table import TableDecoder, TableLimits
    from consumer.amqp.frames import decode_frame

    pristine = pristine_pamqp_decode()
    wire.install()
    from pamqp import decode as installed_decode

    unlimited = TableDecoder(TableLimits(max_bytes=1 << 30, max_entries=1 << 30))
    ordinary = encode.field_table(
        {
            "traceparent": "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01",
            "source": "orders",
            "attempt": 1,
            "x-death": [{"count": 1, "queue": "svc.work", "reason": "rejected"}],
        }
    )
    tables = {"flood": flood_table(entries), "wide": _wide_table(wide), "ordinary": ordinary}
    result: dict[str, Any] = {"kind": "hostile-decode", "repeat": repeat}
    for label, table in tables.items():
        frame = _headers_frame(table)
        decoded = decode_frame(frame).properties.headers or {}
        ways: dict[str, Callable[[], object]] = {
            "pamqp_ms": partial(pristine.field_table, table),
            "installed_ms": partial(installed_decode.METHODS["table"], table),
            "frame_ms": partial(decode_frame, frame),
            "unlimited_ms": partial(unlimited.table, table),
        }
        result[label] = {
            "bytes": len(table),
            **{name: round(_timed(way, repeat), 3) for name, way in ways.items()},
            "decoded": str(decoded)[:120],
        }
    return result


# -- the service scenarios -----------------------------------------------------------------------


async def _publish(
    channel: aiormq.abc.AbstractChannel,
    exchange: str,
    body: bytes,
    headers: dict[str, Any] | None = None,
) -> None:
    properties = commands.Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        message_id=str(uuid.uuid4()),
        headers=headers,
    )
    with forged_tables():
        await channel.basic_publish(
            body, exchange=exchange, routing_key=EVENT_TYPE, properties=properties
        )


async def _committed(dsn: str, ids: list[uuid.UUID]) -> int:
    conn = await asyncpg.connect(dsn)
    try:
        return int(
            await conn.fetchval("SELECT count(*) FROM receipts WHERE event_id = ANY($1)", ids)
        )
    finally:
        await conn.close()


async def _depth(channel: aiormq.abc.AbstractChannel, queue: str) -> tuple[int, int]:
    declared = await channel.queue_declare(queue, passive=True)
    return int(declared.message_count or 0), int(declared.consumer_count or 0)


def _innocents(count: int) -> tuple[list[uuid.UUID], list[bytes]]:
    stamp = datetime.now(UTC).isoformat()
    ids = [uuid.uuid4() for _ in range(count)]
    bodies = [
        encode_event(envelope(event_id, "SKU-1", f"o-{n}", occurred_at=stamp))
        for n, event_id in enumerate(ids)
    ]
    return ids, bodies


class _Service:
    """A throwaway service at its defaults (``service_env`` added) with its own database and
    topology, for the length of an ``async with``."""

    def __init__(self, infra: Infra, name: str, service_env: dict[str, str]) -> None:
        self.infra, self.name, self.service_env = infra, name, service_env
        self.child: Child | None = None
        self.dsn = ""
        self.port = 0

    async def __aenter__(self) -> _Service:
        self.dsn = await self.infra.create_database(self.name, Workload(1, 1, 1))
        env = self.infra.child_env(
            {**self.service_env, **owned_env(self.infra, self.name, self.dsn)}
        )
        self.port = int(env["CONSUMER_HTTP_PORT"])
        await self.infra.run_module("topology", "apply", env=env)
        log = self.infra.log_file(self.name)
        self.child = Child.spawn("service", [sys.executable, "-m", "consumer", "run"], env, log)
        await wait_ready(self.child, self.port)
        return self

    async def __aexit__(self, *_: object) -> None:
        if self.child is not None:
            await self.child.stop()
        for step in (self.infra.sweep_broker, self.infra.drop_all_databases):
            try:
                await step()
            except (BenchError, OSError, asyncpg.PostgresError) as error:
                _progress(f"cleanup failed: {error}")

    def alive(self) -> Child:
        assert self.child is not None
        code = self.child.exited()
        if code is not None:
            raise BenchError(f"the service exited {code}:\n{self.child.log_tail()}")
        return self.child


async def run_bodies(
    infra: Infra, bodies: int, body_mib: int, innocents: int, service_env: dict[str, str]
) -> dict[str, Any]:
    name = infra.name("hostile")
    size = body_mib * 1024 * 1024
    oversized = b"{" + b" " * (size - 2) + b"}"
    ids, innocent_bodies = _innocents(innocents)
    samples: list[float] = []
    async with _Service(infra, name, service_env) as service:
        await asyncio.sleep(2)  # settle after start-up
        at_rest = service.alive().rss_mb()
        connection = await aiormq.connect(infra.amqp_url)
        try:
            channel = await connection.channel()
            started = time.monotonic()
            publishing = asyncio.create_task(
                _publish_all(channel, f"{name}.events", [oversized] * bodies + innocent_bodies)
            )
            while True:
                samples.append(service.alive().rss_mb())
                dead, _ = await _depth(channel, f"{name}.dead")
                work, _ = await _depth(channel, f"{name}.work")
                if publishing.done():
                    publishing.result()
                    if (
                        dead >= bodies
                        and work == 0
                        and await _committed(service.dsn, ids) >= innocents
                    ):
                        break
                if time.monotonic() - started > 600:
                    raise BenchError(f"not settled in 600 s: {dead} dead letters, {work} waiting")
                await asyncio.sleep(0.2)
            elapsed = time.monotonic() - started
            await asyncio.sleep(2)
            after = service.alive().rss_mb()
            peak = service.alive().peak_rss_mb()
            dead, _ = await _depth(channel, f"{name}.dead")
            applied = await _committed(service.dsn, ids)
        finally:
            await connection.close()
    return {
        "kind": "hostile-bodies",
        "bodies": bodies,
        "body_mib": body_mib,
        "innocents": innocents,
        "rss_at_rest_mb": round(at_rest, 1),
        "rss_highest_sample_mb": round(max(samples), 1),
        "rss_after_mb": round(after, 1),
        "peak_hwm_mb": round(peak, 1),
        "seconds": round(elapsed, 1),
        "dead_letters": dead,
        "innocents_applied": applied,
    }


async def _publish_all(
    channel: aiormq.abc.AbstractChannel,
    exchange: str,
    bodies: Sequence[bytes],
    headers: Sequence[dict[str, Any] | None] | None = None,
) -> None:
    for index, body in enumerate(bodies):
        await _publish(channel, exchange, body, headers[index] if headers else None)


async def _healthz(port: int, stop: asyncio.Event, answers: list[float]) -> None:
    async with aiohttp.ClientSession() as session:
        while not stop.is_set():
            started = time.monotonic()
            with contextlib.suppress(aiohttp.ClientError, TimeoutError):
                async with session.get(
                    f"http://127.0.0.1:{port}/healthz", timeout=aiohttp.ClientTimeout(total=30)
                ) as response:
                    await response.read()
            answers.append(time.monotonic() - started)
            await asyncio.sleep(0.1)


async def _receipt_times(dsn: str, ids: list[uuid.UUID]) -> dict[uuid.UUID, float]:
    conn = await asyncpg.connect(dsn)
    try:
        rows = await conn.fetch(
            "SELECT event_id, received_at FROM receipts WHERE event_id = ANY($1)", ids
        )
    finally:
        await conn.close()
    return {row["event_id"]: row["received_at"].timestamp() for row in rows}


async def run_headers(
    infra: Infra, floods: int, entries: int, innocents: int, service_env: dict[str, str]
) -> dict[str, Any]:
    name = infra.name("hostile")
    ids, innocent_bodies = _innocents(innocents)
    flood = RawTable(flood_table(entries))
    stamp = datetime.now(UTC).isoformat()
    # The innocents among the floods, evenly: each waits behind its share of them.
    every = max(1, floods // max(1, innocents))
    order: list[tuple[bytes, dict[str, Any] | None, uuid.UUID | None]] = []
    pending = list(zip(ids, innocent_bodies, strict=True))
    for number in range(floods):
        body = encode_event(envelope(uuid.uuid4(), "SKU-1", f"flood-{number}", occurred_at=stamp))
        order.append((body, flood, None))
        if number % every == every - 1 and pending:
            event_id, innocent = pending.pop(0)
            order.append((innocent, None, event_id))
    order += [(body, None, event_id) for event_id, body in pending]
    published_at: dict[uuid.UUID, float] = {}
    answers: list[float] = []
    async with _Service(infra, name, service_env) as service:
        connection = await aiormq.connect(infra.amqp_url)
        stop = asyncio.Event()
        probe = asyncio.create_task(_healthz(service.port, stop, answers))
        try:
            channel = await connection.channel()
            started = time.monotonic()
            for body, headers, innocent_id in order:
                await _publish(channel, f"{name}.events", body, headers)
                if innocent_id is not None:
                    published_at[innocent_id] = time.time()
            published = time.monotonic() - started
            while True:
                service.alive()
                dead, _ = await _depth(channel, f"{name}.dead")
                # Settled: each flood applied (before issue 29) or dead-lettered, each innocent
                # applied.
                receipts = int(await asyncpg_fetchval(service.dsn, "SELECT count(*) FROM receipts"))
                if receipts + dead >= floods + innocents and (
                    await _committed(service.dsn, ids) >= innocents
                ):
                    break
                if time.monotonic() - started > 900:
                    raise BenchError(f"not settled in 900 s: {dead} dead letters")
                await asyncio.sleep(0.05)
            settled = time.monotonic() - started
            committed = await _receipt_times(service.dsn, ids)
            applied_floods = int(
                await asyncpg_fetchval(service.dsn, "SELECT count(*) FROM receipts") or 0
            ) - len(committed)
        finally:
            stop.set()
            await asyncio.gather(probe, return_exceptions=True)
            await connection.close()
    delays = sorted(committed[event_id] - published_at[event_id] for event_id in committed)
    return {
        "kind": "hostile-headers",
        "floods": floods,
        "entries": entries,
        "header_bytes": len(flood.raw),
        "innocents": innocents,
        "published_s": round(published, 2),
        "all_settled_s": round(settled, 2),
        "innocent_delay_median_s": round(delays[len(delays) // 2], 3),
        "innocent_delay_max_s": round(delays[-1], 3),
        "healthz_max_s": round(max(answers, default=0.0), 3),
        "healthz_answers": len(answers),
        "dead_letters": dead,
        "floods_applied": applied_floods,
    }


async def asyncpg_fetchval(dsn: str, query: str) -> Any:
    conn = await asyncpg.connect(dsn)
    try:
        return await conn.fetchval(query)
    finally:
        await conn.close()


# -- command line --------------------------------------------------------------------------------


def _parser() -> argparse.ArgumentParser:
    summary = (__doc__ or "").split("\n", 1)[0]
    root = argparse.ArgumentParser(prog="python -m bench.hostile", description=summary)
    commands_ = root.add_subparsers(dest="scenario", required=True)
    bodies = commands_.add_parser("bodies", help="oversized bodies: the service's RSS")
    bodies.add_argument("--bodies", type=int, default=24)
    bodies.add_argument("--body-mib", type=int, default=32)
    bodies.add_argument("--innocents", type=int, default=20)
    headers = commands_.add_parser("headers", help="header floods: the innocents' delay")
    headers.add_argument("--floods", type=int, default=200)
    headers.add_argument("--entries", type=int, default=60_000)
    headers.add_argument("--innocents", type=int, default=20)
    decode = commands_.add_parser("decode", help="the flood's table decoded, in process")
    decode.add_argument("--entries", type=int, default=60_000, help="of the flood")
    decode.add_argument("--wide", type=int, default=10_000, help="distinct keys of the wide one")
    decode.add_argument("--repeat", type=int, default=5)
    for scenario in (bodies, headers):
        scenario.add_argument(
            "--amqp-url",
            default=os.environ.get("BENCH_AMQP_URL", "amqp://guest:guest@127.0.0.1:5672/"),
        )
        scenario.add_argument(
            "--admin-dsn",
            default=os.environ.get(
                "BENCH_ADMIN_DSN", "postgresql://postgres@127.0.0.1:5432/postgres"
            ),
        )
        scenario.add_argument(
            "--service-env",
            action="append",
            default=[],
            metavar="KEY=VALUE",
            help="a setting for the service (repeatable)",
        )
    return root


def main(argv: Sequence[str] | None = None) -> int:
    arguments = _parser().parse_args(argv)
    if arguments.scenario == "decode":
        result = run_decode(arguments.entries, arguments.wide, arguments.repeat)
    else:
        service_env = dict(pair.split("=", 1) for pair in arguments.service_env)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        infra = Infra.start(arguments.amqp_url, arguments.admin_dsn, RESULTS, stamp)
        try:
            if arguments.scenario == "bodies":
                result = asyncio.run(
                    run_bodies(
                        infra,
                        arguments.bodies,
                        arguments.body_mib,
                        arguments.innocents,
                        service_env,
                    )
                )
            else:
                result = asyncio.run(
                    run_headers(
                        infra, arguments.floods, arguments.entries, arguments.innocents, service_env
                    )
                )
        except BenchError as error:
            print(f"error: {error}", file=sys.stderr)
            return 1
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
