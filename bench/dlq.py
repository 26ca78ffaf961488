"""``python -m bench dlq``: the dead-letter tools on a queue of 100,000 letters.

A throwaway service name (its own topology, ingress exchange included) gets ``--letters`` dead
letters published straight into its dead-letter exchange, with the headers the service writes.
Then ``consumer dlq list --json`` and ``consumer dlq replay --all`` run as child processes, output
to /dev/null, each timed as a whole process with its peak RSS read from ``wait4`` (the kernel's
high-water mark of that process alone). Replay's copies land in the throwaway work queue (no
service runs): its depth is checked against the letters, and the dead-letter queue against zero.
Everything is deleted at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import time
import uuid
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any

import aio_pika
import aiormq
from pamqp.commands import Basic

from bench.infra import REPO
from consumer.config.settings import Settings
from consumer.registry import HandlerRegistry
from consumer.service.components import names_for, topology_for
from topology.apply import apply_topology
from topology.model import Topology

__all__ = ["DlqOptions", "memory_table", "run_dlq", "run_memory", "table"]

_PUBLISH_WINDOW = 2_000


@dataclass(frozen=True, slots=True)
class DlqOptions:
    letters: int
    payload_bytes: int
    amqp_url: str


@dataclass(frozen=True, slots=True)
class ToolRun:
    command: str
    seconds: float
    peak_rss_mb: float
    exit_code: int

    def rate(self, letters: int) -> float:
        return letters / self.seconds if self.seconds else 0.0


def _environment(name: str, amqp_url: str) -> dict[str, str]:
    # As deployed: compiled bytecode kept, output buffered (this workplace sets both off).
    dropped = ("PYTHONDONTWRITEBYTECODE", "PYTHONUNBUFFERED")
    base = {
        k: v for k, v in os.environ.items() if not k.startswith("CONSUMER_") and k not in dropped
    }
    return {
        **base,
        "CONSUMER_NAME": name,
        "CONSUMER_EXCHANGE": f"{name}.events",
        "CONSUMER_AMQP_URL": amqp_url,
        "PYTHONPATH": str(REPO),
    }


def _letter(index: int, padding: int) -> tuple[bytes, Basic.Properties]:
    event_id = uuid.uuid4()
    now = datetime.now(UTC).isoformat()
    body = json.dumps(
        {
            "event_id": str(event_id),
            "type": "inventory.restock",
            "occurred_at": now,
            "payload": {"sku": f"SKU-{index % 100}", "qty": 1},
        }
    ).encode()
    headers: dict[str, Any] = {
        "consumer-dead-reason": "permanent_failure" if index % 3 else "retries_exhausted",
        "consumer-error-class": "PermanentError",
        "consumer-error-message": "unknown SKU",
        "consumer-dead-lettered-at": now,
        "consumer-attempt": 3,
        # The payload is strict (extra fields forbidden): a producer's header carries the bulk.
        "note": "x" * padding,
    }
    properties = Basic.Properties(
        content_type="application/json",
        delivery_mode=2,
        headers=headers,
        message_id=str(event_id),
    )
    return body, properties


async def _fill(channel: Any, exchange: str, options: DlqOptions) -> None:
    """Publish the letters with confirms, a window at a time (a raw publisher, not the tool)."""
    sent = 0
    while sent < options.letters:
        count = min(_PUBLISH_WINDOW, options.letters - sent)
        publishes = []
        for index in range(sent, sent + count):
            body, properties = _letter(index, options.payload_bytes)
            publishes.append(
                channel.basic_publish(
                    body, exchange=exchange, routing_key="inventory.restock", properties=properties
                )
            )
        await asyncio.gather(*publishes)
        sent += count


async def _depth(connection: aio_pika.abc.AbstractConnection, queue: str) -> int:
    channel = await connection.channel()
    try:
        declared = await channel.declare_queue(queue, passive=True)
        return int(declared.declaration_result.message_count or 0)
    finally:
        await channel.close()


def _timed(args: list[str], env: dict[str, str]) -> ToolRun:
    """Run the tool as a child, its output to /dev/null; wall time and its own peak RSS."""
    started = time.perf_counter()
    with open(os.devnull, "wb") as sink:
        child = subprocess.Popen(args, env=env, stdout=sink, stderr=subprocess.PIPE)
        assert child.stderr is not None
        errors = child.stderr.read()
        _, status, usage = os.wait4(child.pid, 0)
        child.returncode = os.waitstatus_to_exitcode(status)
    seconds = time.perf_counter() - started
    if child.returncode not in (0, 1):
        raise RuntimeError(f"{' '.join(args)} failed: {errors.decode(errors='replace')[-2000:]}")
    # ru_maxrss is in kibibytes on Linux.
    return ToolRun(" ".join(args[1:]), seconds, usage.ru_maxrss / 1024, child.returncode)


async def _cleanup(connection: aio_pika.abc.AbstractConnection, topology: Topology) -> None:
    channel = await connection.channel()
    raw = await channel.get_underlay_channel()
    for queue in topology.queues:
        await raw.queue_delete(queue.name)
    for exchange in topology.exchanges:
        await raw.exchange_delete(exchange.name)
    await channel.close()


async def run_dlq(options: DlqOptions) -> dict[str, Any]:
    name = f"bench-dlq-{uuid.uuid4().hex[:8]}"
    env = _environment(name, options.amqp_url)
    settings = Settings(name=name, exchange=f"{name}.events", amqp_url=options.amqp_url)
    names = names_for(settings)
    topology = topology_for(settings, HandlerRegistry.from_modules(settings.handlers))
    connection = await aio_pika.connect(options.amqp_url)
    try:
        await apply_topology(connection, topology)
        channel = await connection.channel(publisher_confirms=True)
        raw = await channel.get_underlay_channel()
        started = time.perf_counter()
        await _fill(raw, names.dlx, options)
        fill_seconds = time.perf_counter() - started
        await channel.close()
        tool = [str(REPO / ".venv" / "bin" / "consumer"), "dlq"]
        listed = await asyncio.to_thread(_timed, [*tool, "list", "--json"], env)
        dead_after_list = await _depth(connection, names.dead)
        replayed = await asyncio.to_thread(_timed, [*tool, "replay", "--all"], env)
        dead_after_replay = await _depth(connection, names.dead)
        work_after_replay = await _depth(connection, names.work)
    except aiormq.exceptions.AMQPError as error:
        raise RuntimeError(f"the broker refused: {error}") from error
    finally:
        await _cleanup(connection, topology)
        await connection.close()
    return {
        "kind": "dlq",
        "letters": options.letters,
        "body_bytes": len(_letter(0, options.payload_bytes)[0]),
        "fill_seconds": round(fill_seconds, 2),
        "list": _run_dict(listed, options.letters),
        "replay": _run_dict(replayed, options.letters),
        "dead_after_list": dead_after_list,
        "dead_after_replay": dead_after_replay,
        "work_after_replay": work_after_replay,
    }


def _run_dict(run: ToolRun, letters: int) -> dict[str, Any]:
    return {
        "command": run.command,
        "seconds": round(run.seconds, 2),
        "per_second": round(run.rate(letters)),
        "peak_rss_mb": round(run.peak_rss_mb, 1),
        "exit_code": run.exit_code,
    }


def table(result: dict[str, Any]) -> str:
    lines = [
        f"dead-letter tools on {result['letters']} letters of {result['body_bytes']} bytes "
        f"(filled in {result['fill_seconds']} s)",
        f"{'command':<28} {'seconds':>8} {'letters/s':>10} {'peak RSS MB':>12} {'exit':>5}",
    ]
    for key in ("list", "replay"):
        run = result[key]
        lines.append(
            f"{run['command'][-28:]:<28} {run['seconds']:>8} {run['per_second']:>10} "
            f"{run['peak_rss_mb']:>12} {run['exit_code']:>5}"
        )
    lines.append(
        f"after list: {result['dead_after_list']} dead; after replay: "
        f"{result['dead_after_replay']} dead, {result['work_after_replay']} in the work queue"
    )
    return "\n".join(lines)


MEMORY_GOAL = 1.10
"""Issue 31: the replay's peak RSS at the largest count at most 10% above that at the smallest."""


async def run_memory(options: DlqOptions, counts: tuple[int, ...]) -> dict[str, Any]:
    """:func:`run_dlq` at each of ``counts`` letters, one after another in one invocation, and
    the replay's and the list's peak RSS at the last count over the first."""
    runs = []
    for count in counts:
        runs.append(await run_dlq(replace(options, letters=count)))
    first, last = runs[0], runs[-1]
    replay_ratio = last["replay"]["peak_rss_mb"] / first["replay"]["peak_rss_mb"]
    list_ratio = last["list"]["peak_rss_mb"] / first["list"]["peak_rss_mb"]
    return {
        "kind": "dlq-memory",
        "counts": list(counts),
        "runs": runs,
        "replay_peak_ratio": round(replay_ratio, 3),
        "list_peak_ratio": round(list_ratio, 3),
        "goal": MEMORY_GOAL,
        "met": replay_ratio <= MEMORY_GOAL,
    }


def memory_table(result: dict[str, Any]) -> str:
    lines = [
        f"{'letters':>9} {'list s':>7} {'list MB':>8} {'replay s':>9} {'replay/s':>9} "
        f"{'replay MB':>10} {'left dead':>9} {'in work':>8}"
    ]
    for run in result["runs"]:
        lines.append(
            f"{run['letters']:>9} {run['list']['seconds']:>7} {run['list']['peak_rss_mb']:>8} "
            f"{run['replay']['seconds']:>9} {run['replay']['per_second']:>9} "
            f"{run['replay']['peak_rss_mb']:>10} {run['dead_after_replay']:>9} "
            f"{run['work_after_replay']:>8}"
        )
    lines.append(
        f"replay peak RSS, {result['counts'][-1]} / {result['counts'][0]} letters: "
        f"{result['replay_peak_ratio']} (goal <= {result['goal']}: "
        f"{'met' if result['met'] else 'NOT met'}); list: {result['list_peak_ratio']}"
    )
    return "\n".join(lines)
