"""``python -m bench soak``: a long run of the service under a steady stream, watching its memory.

The producer keeps the work queue topped up (a bounded backlog, so the broker does not hold a
million messages) until ``--events`` are published; every ``--sample-seconds`` the harness reads
the service's RSS (``/proc/<pid>/status`` VmRSS) and how many effects are committed. Growth is the
last sample against the first one after the warm-up (``--warmup-fraction`` of the events). The
target: growth under 10% and RSS under 150 MB at the default prefetch.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import asyncpg

from bench import procfs
from bench.events import EVENT_TYPE, Workload, encode
from bench.infra import BenchError, Child, Infra, Producer
from bench.measure import check_effects, owned_env, wait_ready
from bench.run import effective_knobs, progress, server_versions, versions


@dataclass(frozen=True)
class SoakOptions:
    events: int
    skus: int
    seed: int
    service_env: dict[str, str]
    sample_seconds: float
    warmup_fraction: float
    backlog: int
    rss_limit_mb: float
    growth_limit: float
    amqp_url: str
    admin_dsn: str
    results_dir: Path
    keep_logs: bool


async def _produce(infra: Infra, workload: Workload, name: str, backlog: int) -> None:
    """Publish the workload, keeping between ``backlog / 2`` and ``backlog`` messages ready."""
    events = (encode(event) for event in workload.envelopes())
    chunk = max(1, backlog // 2)
    sent = 0
    async with Producer(infra.amqp_url) as producer:
        while sent < workload.events:
            if await producer.depth(f"{name}.work") < chunk:
                batch = [body for _, body in zip(range(chunk), events, strict=False)]
                sent += await producer.publish(f"{name}.events", EVENT_TYPE, batch)
            else:
                await asyncio.sleep(0.05)


async def run_soak(options: SoakOptions) -> dict[str, Any]:
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    infra = Infra.start(options.amqp_url, options.admin_dsn, options.results_dir, stamp)
    workload = Workload(options.events, options.skus, options.seed)
    name = infra.name("soak")
    knobs = effective_knobs(options.service_env)
    result: dict[str, Any] = {
        "kind": "soak",
        "started": stamp,
        "events": options.events,
        "skus": options.skus,
        "settings": {"service": {**knobs, **options.service_env}, "backlog": options.backlog},
        "versions": {**versions(), **await server_versions(options.amqp_url, options.admin_dsn)},
    }
    samples: list[dict[str, float]] = []
    progress(f"soak {name}: {options.events:,} events, a sample every {options.sample_seconds}s")
    try:
        dsn = await infra.create_database(name, workload)
        env = infra.child_env({**options.service_env, **owned_env(infra, name, dsn)})
        await infra.run_module("topology", "apply", env=env)
        # A million "message settled" lines would fill the disk: logs only with --keep-logs.
        log = infra.log_file("soak-service") if options.keep_logs else Path("/dev/null")
        child = Child.spawn("service", [sys.executable, "-m", "consumer", "run"], env, log)
        try:
            await wait_ready(child, int(env["CONSUMER_HTTP_PORT"]))
            producer = asyncio.create_task(_produce(infra, workload, name, options.backlog))
            try:
                await _sample(child, dsn, options, samples, producer)
            finally:
                producer.cancel()
                await asyncio.gather(producer, return_exceptions=True)
        finally:
            code = await child.stop()
        result["exit_code"] = code
        result["effects"] = await check_effects(dsn, name, options.events)
    finally:
        for step in (infra.sweep_broker, infra.drop_all_databases):
            try:
                await step()
            except (BenchError, OSError, asyncpg.PostgresError) as error:
                progress(f"cleanup failed: {error}")
    result["samples"] = samples
    result["summary"] = summarize(samples, options)
    return result


async def _sample(
    child: Child,
    dsn: str,
    options: SoakOptions,
    samples: list[dict[str, float]],
    producer: asyncio.Task[None],
) -> None:
    conn = await asyncpg.connect(dsn)
    started = time.time()
    last_change, last_count = started, -1
    try:
        while True:
            watch = procfs.CpuWatch({"service": child.pid})
            watch.start(time.time())
            await asyncio.sleep(options.sample_seconds)
            if producer.done() and producer.exception() is not None:
                raise BenchError(f"the producer failed: {producer.exception()}")
            code = child.exited()
            if code is not None:
                raise BenchError(f"the service exited {code} (run with --keep-logs to see why)")
            count = int(await conn.fetchval("SELECT count(*) FROM stock_movements"))
            now = time.time()
            sample = {
                "t_s": round(now - started, 1),
                "committed": count,
                "rss_mb": round(procfs.rss_mb([child.pid]), 1),
                "hwm_mb": round(procfs.rss_mb([child.pid], "VmHWM"), 1),
                "cpu_pct": watch.stop(now).get("service", 0.0),
            }
            samples.append(sample)
            progress(
                f"  {sample['t_s']:>7.0f}s {count:>10,} committed  RSS {sample['rss_mb']:>6.1f} MB"
                f"  peak {sample['hwm_mb']:>6.1f} MB  cpu {sample['cpu_pct']:.0f}%"
            )
            if count >= options.events:
                return
            if count != last_count:
                last_change, last_count = now, count
            elif now - last_change > 120:
                raise BenchError(f"no progress for 120s at {count:,}/{options.events:,}")
    finally:
        await conn.close()


def summarize(samples: list[dict[str, float]], options: SoakOptions) -> dict[str, Any]:
    if not samples:
        return {"pass": False, "reason": "no samples"}
    warm_after = options.events * options.warmup_fraction
    warm = next((s for s in samples if s["committed"] >= warm_after), samples[-1])
    last = samples[-1]
    growth = (last["rss_mb"] - warm["rss_mb"]) / warm["rss_mb"] if warm["rss_mb"] else 0.0
    peak = max(s["hwm_mb"] for s in samples)
    rate = last["committed"] / last["t_s"] if last["t_s"] else 0.0
    return {
        "warm_sample": warm,
        "last_sample": last,
        "rss_growth_pct": round(100 * growth, 1),
        "peak_rss_mb": peak,
        "mean_rate": round(rate, 1),
        "growth_limit_pct": round(100 * options.growth_limit, 1),
        "rss_limit_mb": options.rss_limit_mb,
        "pass": growth < options.growth_limit and peak < options.rss_limit_mb,
    }


def table(result: dict[str, Any]) -> str:
    summary = result["summary"]
    settings = result["settings"]["service"]
    lines = [
        f"rabbit-pg-consumer soak {result['started']}: {result['events']:,} events, "
        + ", ".join(f"{key}={value}" for key, value in settings.items()),
        "",
        f"{'t s':>8}{'committed':>12}{'RSS MB':>9}{'peak MB':>9}{'cpu %':>7}",
    ]
    samples = result["samples"]
    step = max(1, len(samples) // 20)
    shown = samples[::step] + ([samples[-1]] if samples and (len(samples) - 1) % step else [])
    for sample in shown:
        lines.append(
            f"{sample['t_s']:>8.0f}{sample['committed']:>12,}{sample['rss_mb']:>9.1f}"
            f"{sample['hwm_mb']:>9.1f}{sample['cpu_pct']:>7.0f}"
        )
    if "warm_sample" in summary:
        warm, last = summary["warm_sample"], summary["last_sample"]
        lines += [
            "",
            f"RSS after warm-up ({warm['committed']:,} committed) {warm['rss_mb']:.1f} MB -> "
            f"last {last['rss_mb']:.1f} MB: growth {summary['rss_growth_pct']:+.1f}% "
            f"(target < {summary['growth_limit_pct']:.0f}%); peak {summary['peak_rss_mb']:.1f} MB "
            f"(target < {summary['rss_limit_mb']:.0f} MB); mean {summary['mean_rate']:,.0f} msg/s",
            f"verdict: {'PASS' if summary['pass'] else 'FAIL'}",
        ]
    return "\n".join(lines)
