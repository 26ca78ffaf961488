"""Runs the scenarios of a profile, one after the other, on one throwaway RabbitMQ node and one
throwaway PostgreSQL cluster of the run's own; every scenario gets a fresh ``CONSUMER_NAME`` (so
its own queues and ingress exchange) and a fresh database. Everything is bounded in time, and
whatever the run started is stopped and removed on the way out.

Per scenario: start the consumers, publish the workload at a steady rate while the faults strike
at set shares of the effects (and, where the scenario expects consumers to exit by themselves,
restart each one that does, as a supervisor would), wait until the queues are quiet (on a
cluster, then apply the runbook's step to what RabbitMQ holds back in dead-lettering, see
:mod:`.stranded`, and wait again), scrape ``/metrics``, stop the consumers with SIGTERM, then
read the end state and check every invariant (:mod:`.verify`).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import asyncpg

from consumer.config.queue_table import QueueTable
from consumer.db.migrations import migrate
from tests.chaos import shards, table
from tests.chaos.faults import Fault
from tests.chaos.netfaults import flow_findings, partition_findings
from tests.chaos.netsite import NetSite, from_tester, net_site
from tests.chaos.observe import (
    EndState,
    QueueProbe,
    list_dead_letters,
    read_database,
    read_republished,
    sample_messages,
    take_dead_letters,
)
from tests.chaos.producer import Attempt, Gates, PublishLog, ResilientProducer, merged
from tests.chaos.report import FaultRecord, RunReport, ScenarioResult
from tests.chaos.resources import RssSampler, cpu_seconds, cpu_used, memory_budget
from tests.chaos.scenarios import CONSUMER_SETTINGS, Profile, Scenario, chosen
from tests.chaos.stranded import Stranding, held_back, recover
from tests.chaos.verify import (
    Resources,
    Throughput,
    Verdict,
    check,
    check_resources,
    dead_by_reason,
    excuse_losses,
)
from tests.chaos.workload import (
    ATTACK,
    SEED_STOCK,
    SKUS,
    UNKNOWN,
    Kind,
    Workload,
    combine,
    gathered,
    plan_block,
    plan_workload,
)
from tests.chaos.world import World
from tests.servers import (
    PostgresServer,
    ThrowawayPostgres,
    ThrowawayPostgresPair,
    ThrowawayRabbit,
    ThrowawayRabbitCluster,
    free_port,
)
from tests.support import REPO, TestEnv, connect_any
from topology.durations import format_duration

SCHEMA = Path(__file__).with_name("schema.sql")
RESULTS = Path(__file__).with_name("results")
QUIET_FOR = 10.0
"""Queues empty and nothing changing this long: whatever is missing will not come."""
MIN_SCENARIO_SECONDS = 20.0
"""A scenario is not started with less of the run's budget left."""
LEAD = 0.06
"""Publications that go out past a fault's point (a share of all) before the stream waits for it."""
BLOCK_RATE = 100_000.0
"""The clean and attacked blocks go out as fast as the broker confirms them: the consumers'
throughput is what is measured, not the producer's pace."""
BLOCK_TIMEOUT = 120.0
"""A block's innocents must be applied within this."""
TAIL_SECONDS = 60.0
"""The id collisions' victims are waited for, and the collisions published, within this at least."""
HOLD_AT_MOST = 40.0
"""How long the consumers stay SIGSTOPped while a block is published: inside the measuring
scenario's hard time limit (:data:`~tests.chaos.scenarios.MEASURING_HARD_TIMEOUT`: its watchdog
thread, stopped with them, sees the stop as a blocked loop) and the broker's 60s heartbeat. The
long profile's attacked block takes about 20s to publish: RabbitMQ is slow with 120 KB header
tables and 32 MiB bodies."""
GATE_GRACE = 10.0
"""The stream waits at a fault's gate; if its share of effects is not reached this long after,
the fault strikes anyway (and the report says it was late)."""
FAULT_HOLD = 30.0
"""What the stream's deadline allows per fault beyond :data:`GATE_GRACE`: the fault and the
consumers' readiness after it (a RabbitMQ restart took 28-34s at a load average of 18, eight
relay kills and restarts 2-20s each: issue 34's long runs, whose streams ran out of time)."""


def _say(message: str) -> None:
    print(f"[chaos {datetime.now(UTC):%H:%M:%S}] {message}", file=sys.stderr, flush=True)


async def _admin(dsn: str, statement: str) -> None:
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        await conn.execute(statement)
    finally:
        await conn.close()


async def _make_template(postgres: PostgresServer, name: str) -> None:
    await _admin(postgres.admin_dsn, f'CREATE DATABASE "{name}"')
    conn = await asyncpg.connect(postgres.dsn(name), timeout=10)
    try:
        await migrate(conn)
        await conn.execute(SCHEMA.read_text())
        # Every reserve must succeed whatever the order: each SKU starts with plenty.
        await conn.execute(
            "INSERT INTO stock (sku, available) SELECT unnest($1::text[]), $2",
            list(SKUS),
            SEED_STOCK,
        )
    finally:
        await conn.close()


def _output(*argv: str) -> str:
    return subprocess.run(argv, capture_output=True, text=True, cwd=REPO, timeout=30).stdout.strip()


def _versions(rabbit: ThrowawayRabbit, postgres: ThrowawayPostgres) -> dict[str, str]:
    found: dict[str, str] = {"python": sys.version.split()[0]}
    with contextlib.suppress(Exception):
        found["rabbitmq"] = _output(*rabbit.ctl_command(), "version") or "?"
    with contextlib.suppress(Exception):
        found["postgresql"] = _output(str(postgres.bin / "postgres"), "--version").split()[2]
    with contextlib.suppress(Exception):
        commit = _output("git", "rev-parse", "--short", "HEAD")
        dirty = _output("git", "status", "--porcelain", "--untracked-files=no")
        found["commit"] = commit + (" (with uncommitted changes)" if dirty else "")
    found["cores"] = str(len(os.sched_getaffinity(0)))
    return found


SHOWN_SETTINGS = (
    "prefetch",
    "db_pool_size",
    "batch_size",
    "batch_wait",
    "retry_delays",
    "delivery_limit",
    "handler_timeout",
    "hard_timeout",
    "db_stall_timeout",
    "shutdown_grace",
    "reconnect_max_delay",
    "publish_timeout",
)


def _shown_settings(overrides: dict[str, str]) -> dict[str, str]:
    """The consumers' effective settings that matter here (the product's defaults, the test
    environment's, the suite's and the command line's), as ``CONSUMER_*`` values."""
    settings = TestEnv(
        "chaos", "postgresql://x@127.0.0.1/x", "amqp://x@127.0.0.1/", 1, Path()
    ).settings(**overrides)
    shown: dict[str, str] = {}
    for name in SHOWN_SETTINGS:
        value = getattr(settings, name, None)
        if isinstance(value, timedelta):
            text = format_duration(value)
        elif isinstance(value, list | tuple):
            text = ",".join(format_duration(item) for item in value)
        else:
            text = str(value)
        shown[f"CONSUMER_{name.upper()}"] = text
    return shown


async def run(
    profile: Profile,
    *,
    command: str,
    results_dir: Path = RESULTS,
    only: Sequence[str] = (),
    settings: dict[str, str] | None = None,
    events: int | None = None,
    seed: int = 1,
    keep_logs: bool = False,
) -> RunReport:
    """Run the profile's scenarios (or ``only`` those); save and return the report."""
    started = time.monotonic()
    deadline = started + profile.budget
    if events is not None:  # every scenario's
        profile = Profile(
            **{
                **profile.__dict__,
                "events": events,
                "hostile_events": None,
                "cluster_events": None,
                "pruning_events": None,
                "net_events": None,
                "outbox_events": None,
            }
        )
    scenarios = chosen(profile, only)
    overrides = {**CONSUMER_SETTINGS, **(settings or {})}
    run_id = uuid.uuid4().hex[:6]
    stamp = datetime.now(UTC)
    log_root = results_dir / f"logs-{profile.name}-{stamp:%Y%m%dT%H%M%SZ}"
    rabbit = ThrowawayRabbit()
    postgres = ThrowawayPostgres()
    cluster = ThrowawayRabbitCluster() if any(s.site == "cluster" for s in scenarios) else None
    if cluster is not None and any(shards.sharded(s.queue_table) for s in scenarios):
        cluster.enable_plugins(shards.HASH_PLUGIN)
    lab = contextlib.AsyncExitStack()
    net: NetSite | None = None
    net_cluster: NetSite | None = None
    report = RunReport(
        profile=profile.name,
        command=command,
        started_at=stamp,
        environment={},
        settings=_shown_settings(overrides),
    )
    try:
        _say(
            f"{profile.name} profile: starting a throwaway RabbitMQ node ({rabbit.node}, port "
            f"{rabbit.port}) and PostgreSQL cluster ({postgres.base}, port {postgres.port})"
        )

        def start_postgres() -> None:
            postgres.init()
            postgres.start()

        starting = [asyncio.to_thread(rabbit.start), asyncio.to_thread(start_postgres)]
        if cluster is not None:
            _say(f"and a three-node RabbitMQ cluster ({', '.join(n.node for n in cluster.nodes)})")
            starting.append(asyncio.to_thread(cluster.start))
        await asyncio.gather(*starting)
        if any(s.site == "net" for s in scenarios):
            _say("and the network-fault lab: PostgreSQL, RabbitMQ and the service in namespaces")
            net = await lab.enter_async_context(net_site())
            async with from_tester(net):
                await _make_template(net.postgres, f"chaos_{run_id}_template")
        if any(s.site == "net-cluster" for s in scenarios):
            _say("and a network-fault lab with a three-node RabbitMQ cluster, a node per namespace")
            net_cluster = await lab.enter_async_context(net_site(cluster=True))
            if net_cluster.cluster is not None and net_cluster.cluster.start_seconds is not None:
                report.environment["lab cluster start"] = (
                    f"{net_cluster.cluster.start_seconds:.1f}s"
                )
            async with from_tester(net_cluster):
                await _make_template(net_cluster.postgres, f"chaos_{run_id}_template")
        report.environment = {**_versions(rabbit, postgres), **report.environment}
        if cluster is not None and cluster.start_seconds is not None:
            report.environment["cluster start"] = f"{cluster.start_seconds:.1f}s"
        template = f"chaos_{run_id}_template"
        await _make_template(postgres, template)
        for number, scenario in enumerate(scenarios):
            result = ScenarioResult(scenario.slug, scenario.title, scenario.consumers)
            report.results.append(result)
            left = deadline - time.monotonic()
            if left < MIN_SCENARIO_SECONDS:
                result.skipped = f"the run's {profile.budget:.0f}s budget was spent"
                continue
            _say(f"scenario {scenario.slug}: {scenario.title}")
            in_lab = {"net": net, "net-cluster": net_cluster}.get(scenario.site)
            try:
                async with from_tester(in_lab):
                    await asyncio.wait_for(
                        run_scenario(
                            result,
                            scenario,
                            profile,
                            rabbit=rabbit if in_lab is None else in_lab.rabbit,
                            postgres=postgres if in_lab is None else in_lab.postgres,
                            cluster=cluster if in_lab is None else in_lab.cluster,
                            net=in_lab,
                            template=template,
                            name=f"chaos{run_id}-{number}-{scenario.slug}",
                            overrides={**overrides, **scenario.settings},
                            seed=seed + number,
                            log_dir=log_root / scenario.slug,
                            run_deadline=deadline,
                        ),
                        timeout=left,
                    )
            except TimeoutError:
                result.error = f"stopped when the run's {profile.budget:.0f}s budget ran out"
            _say(
                f"scenario {scenario.slug}: {'invariants hold' if result.ok else 'FAILED'} "
                f"in {result.seconds:.0f}s"
            )
            if result.verdict is not None and not result.ok:
                for violation in result.verdict.violations[:5]:
                    _say(f"  violated: {violation[:300]}")
            if result.ok and not keep_logs:
                shutil.rmtree(log_root / scenario.slug, ignore_errors=True)
    finally:
        _say("removing the throwaway servers")
        with contextlib.suppress(Exception):
            await lab.aclose()

        def remove_postgres() -> None:
            postgres.signal_all(signal.SIGCONT)
            postgres.stop()
            shutil.rmtree(postgres.base, ignore_errors=True)

        await asyncio.gather(
            asyncio.to_thread(rabbit.destroy),
            asyncio.to_thread(remove_postgres),
            *([asyncio.to_thread(cluster.destroy)] if cluster is not None else []),
            return_exceptions=True,
        )
        with contextlib.suppress(OSError):
            log_root.rmdir()  # only if empty
        report.seconds = time.monotonic() - started
    path = report.save(results_dir)
    _say(f"saved {path}")
    return report


def _expiry_age(env: TestEnv) -> timedelta:
    """The age past which the consumers refuse an event as ``expired``."""
    settings = env.settings()
    return settings.receipt_retention - settings.receipt_margin


async def run_scenario(
    result: ScenarioResult,
    scenario: Scenario,
    profile: Profile,
    *,
    rabbit: ThrowawayRabbit,
    postgres: ThrowawayPostgres,
    cluster: ThrowawayRabbitCluster | None = None,
    net: NetSite | None = None,
    template: str,
    name: str,
    overrides: dict[str, str],
    seed: int,
    log_dir: Path,
    run_deadline: float,
) -> None:
    """Run one scenario and fill in ``result`` (also when cancelled part-way)."""
    started = time.monotonic()
    database = name.replace("-", "_")
    log_dir.mkdir(parents=True, exist_ok=True)
    on_cluster = cluster if scenario.site in ("cluster", "net-cluster") else None
    pair = None
    if scenario.site in ("pg-sync", "pg-async"):
        pair = ThrowawayPostgresPair(synchronous=scenario.site == "pg-sync")
    server: PostgresServer = pair or postgres
    env = TestEnv(
        name=name,
        database_url=server.dsn(database),
        amqp_url=rabbit.url if on_cluster is None else on_cluster.url_list,
        http_port=free_port(),
        log_dir=log_dir,
        overrides={"exchange": f"{name}.events", **overrides},
    )
    if scenario.queue_table:  # before the consumers are made: their environment names it
        env.use_queue_table(scenario.queue_table, log_dir)
    world = World(
        env=env,
        rabbit=rabbit,
        postgres=postgres,
        consumers=scenario.consumers,
        self_exits=scenario.self_exits,
        cluster=on_cluster,
        pair=pair,
        net=net,
        service_amqp_url=(
            net.proxied_amqp_url()
            if net is not None and scenario.via_proxy
            else rabbit.url + scenario.amqp_query
            if scenario.amqp_query
            else None
        ),
        clock_file=log_dir / "clock-offset" if scenario.faked_clock else None,
        service_database_url=(
            net.proxied_dsn(database) if net is not None and scenario.via_proxy else None
        ),
        proxy_control=log_dir / "proxy-control" if scenario.via_proxy else None,
        first_node=scenario.first_node,
        wraps_relay=scenario.wraps_relay,
        queues_of=scenario.processes,
    )
    events = scenario.events or profile.events
    progress = asyncio.create_task(world.progress.run(), name="progress")
    publishing: asyncio.Task[PublishLog] | None = None
    supervisor: asyncio.Task[None] | None = None
    sampling: asyncio.Task[None] | None = None
    proxy: subprocess.Popen[bytes] | None = None
    try:
        if net is not None and world.proxy_control is not None:
            proxy = net.start_proxy(world.proxy_control)
        if pair is not None:  # a pair of the scenario's own: a failover spends it
            await asyncio.to_thread(pair.start)
            await _make_template(pair, template)
        await _admin(server.admin_dsn, f'CREATE DATABASE "{database}" TEMPLATE "{template}"')
        if scenario.database_setup:
            await _admin(env.database_url, scenario.database_setup)
        if scenario.queue_table:
            await table.set_up(env, scenario.faulty_queue)
        else:
            await env.apply_topology()
            await env.bind_type(UNKNOWN)
        await world.start(*range(scenario.consumers))
        # Planned once the consumers are up: the events' occurred_at is now, not a start-up ago.
        attack = {k: n for k, n in scenario.mix_in.items() if scenario.measures and k in ATTACK}
        workload = plan_workload(
            events,
            seed=seed,
            faults={k: n for k, n in scenario.mix_in.items() if k not in attack},
            oversized=profile.oversized_bytes,
        )
        if scenario.trouble is not None:
            workload = gathered(workload, scenario.mix_in.keys(), *scenario.trouble)
        keys: dict[str, str] = {}
        placed: shards.Placement | None = None
        if shards.sharded(scenario.queue_table) and on_cluster is not None:
            keys = shards.shard_keys(workload)
            queues = table.broker_queues(env)
            [exchange] = queues.hash.values()
            placed = await shards.place(on_cluster, exchange, queues.shards, workload, keys)
        if scenario.self_exits or scenario.supervised:
            supervisor = asyncio.create_task(world.supervise(), name="supervisor")
        blocks: list[Workload] = []
        block_logs: list[PublishLog] = []
        resources: Resources | None = None
        sampler: RssSampler | None = None
        if scenario.measures:
            sampler = RssSampler(world.pids)
            sampling = asyncio.create_task(sampler.run(), name="rss")
            resources = Resources()
            # The CPU attack (header floods: issue 29's item 2, whose floor this is) and the
            # memory attack (oversized bodies: item 1, the RSS sampled all along) in blocks of
            # their own: the bodies' innocents wait for the broker to stream hundreds of MiB and
            # for the consumers to read them off the socket, a cost in bytes, not the decoder's.
            floods: dict[Kind, int] = {
                k: n for k, n in attack.items() if k is not Kind.BODY_TOO_LARGE
            }
            bodies: dict[Kind, int] = {k: n for k, n in attack.items() if k is Kind.BODY_TOO_LARGE}
            blocks = [
                plan_block("c", profile.probe, seed=seed + 7919),
                plan_block("a", profile.probe, seed=seed + 7920, burst=floods),
            ]
            if bodies:
                blocks.append(
                    plan_block(
                        "b",
                        profile.probe,
                        seed=seed + 7921,
                        burst=bodies,
                        oversized=profile.oversized_bytes,
                    )
                )
            resources.clean, clean_log = await _measure(world, blocks[0])
            _say(f"  clean: {_rate(resources.clean)}")
            resources.attack, attack_log = await _measure(world, blocks[1])
            _say(f"  among header floods: {_rate(resources.attack)}")
            block_logs = [clean_log, attack_log]
            if bodies:
                resources.bodies, bodies_log = await _measure(world, blocks[2])
                _say(f"  among oversized bodies: {_rate(resources.bodies)}")
                block_logs.append(bodies_log)
        # Publishing takes events / rate; faults and a slow machine can stretch it, within bounds:
        # the stream waits at each fault's gate (up to GATE_GRACE) and for the consumers to be
        # ready again after it (30s and more for a restart on a loaded machine).
        rate = scenario.rate or profile.rate
        holding = len(scenario.faults) * (GATE_GRACE + FAULT_HOLD)
        publish_deadline = min(
            run_deadline + 60, time.monotonic() + events / rate * 3 + 90 + holding
        )
        producer = ResilientProducer(env.amqp_url, env.settings().exchange, shard_keys=keys)
        stream = [p for p in workload.publications if p.event.kind is not Kind.ID_CONFLICT]
        total = len(stream)
        gates = Gates(
            [min(total, math.ceil((share + LEAD) * total)) for share, _ in scenario.schedule()]
        )
        publishing = asyncio.create_task(
            producer.publish_all(stream, rate=rate, deadline=publish_deadline, gates=gates)
        )
        try:
            result.faults = await _inject(world, scenario, workload, gates, publish_deadline)
        finally:
            gates.open()
        log = await publishing
        for stretch in world.background:  # a degraded stretch ends before the queues settle
            await stretch
        if workload.tail:
            # Each id collision once its victim is applied: the innocent is the one applied. A
            # deadline of their own: on a slow machine the victims come late, not never.
            tail_deadline = max(publish_deadline, time.monotonic() + TAIL_SECONDS)
            await _until_applied(env.database_url, workload.victims, tail_deadline)
            tail = ResilientProducer(env.amqp_url, env.settings().exchange)
            log = merged(
                log,
                await tail.publish_all(workload.tail, rate=rate, deadline=tail_deadline),
            )
        log = merged(*block_logs, log)
        workload = combine(*blocks, workload)
        waited = await _settle(
            world, workload, log, timeout=scenario.settle_timeout or profile.settle_timeout
        )
        if waited is not None:
            world.notes.append(waited)
        stranding = Stranding()
        if on_cluster is not None:
            held = await held_back(on_cluster, _busy_queues(env), world.notes)
            if held:
                _say(f"  stranded in dead-lettering: {held}; applying the runbook's step")
                stranding = await recover(on_cluster, held)
                world.notes += stranding.notes()
                waited = await _settle(
                    world, workload, log, timeout=scenario.settle_timeout or profile.settle_timeout
                )
                if waited is not None:
                    world.notes.append(f"after the runbook's step: {waited}")
        if supervisor is not None:
            supervisor.cancel()
            with contextlib.suppress(BaseException):
                await supervisor
        if sampler is not None and resources is not None:
            resources.peak_rss_bytes = sampler.finish()
            resources.budget_bytes = memory_budget(
                line for service in world.services for line in service.log_lines()
            )
        await world.stop_all()
        state = EndState()
        await _count_leftovers(env, state)
        if on_cluster is not None:
            await _stranded(on_cluster, env, world)
        for label, dead in table.broker_queues(env).dead.items():
            await list_dead_letters(env.env(), state, label or None)
            await take_dead_letters(env.amqp_url, dead, state, label)
        await read_database(env.database_url, name, state)
        if scenario.wraps_relay:
            await read_republished(env.database_url, world.relay_kill_records(), state)
        if placed is not None and on_cluster is not None:
            world.notes += await _shard_findings(
                on_cluster, world, workload, placed, keys, state, log.sent_at
            )
        verdict = check(
            workload,
            log,
            state,
            extra_dead_allowed=scenario.cuts_broker_links,
            expired_copies=_expiry_age(env) if scenario.expired_copies else None,
            consumer=name,
        )
        result.metrics, failures = world.metrics_check(
            state.applied,
            dead_by_reason(state),
            scenario.cuts_broker_links,
            lost_commit_replies=scenario.loses_commit_replies,
        )
        verdict.violations += failures
        if scenario.queue_table:
            verdict.notes += await _queue_by_queue(world, scenario, workload, log, state, verdict)
        if scenario.losses_reported:
            excuse_losses(verdict, "reported, not a violation: asynchronous replication")
        verdict.violations += world.unexpected_exits + world.violations
        if scenario.relays_all:
            verdict.violations += _relays_idle(world, verdict)
        verdict.figures.restarts = world.restarts
        verdict.figures.stranded = stranding.stranded
        verdict.figures.recovered = stranding.recovered
        if scenario.keeps_broker_links:
            verdict.violations += _broken_links(world)
        if scenario.never_pauses and (pauses := world.pauses()):
            verdict.violations.append(
                f"the consumers paused: {len(pauses)} log lines say pausing "
                f"(first: {pauses[0][:300]})"
            )
        if resources is not None:
            check_resources(resources, verdict)
        verdict.notes += world.notes + world.log_findings()
        verdict.notes += await partition_findings(world, scenario.lost_event)
        if scenario.via_proxy:
            verdict.notes += flow_findings(world)
        result.verdict = verdict
    except Exception as error:  # report what could not be run, and go on with the next
        result.error = f"{type(error).__name__}: {error}"
        _say(f"scenario {scenario.slug} stopped: {result.error}")
    finally:
        tasks: list[asyncio.Task[Any] | None] = [publishing, supervisor, progress, sampling]
        for task in [*tasks, *world.background]:
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(BaseException):
                    await task
        world.kill_everything()
        if proxy is not None:
            proxy.kill()
            proxy.wait(timeout=10)
        postgres.signal_all(signal.SIGCONT)
        with contextlib.suppress(Exception):
            await _remove_broker_objects(env)
        with contextlib.suppress(Exception):
            await _admin(server.admin_dsn, f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')
        if pair is not None:
            await asyncio.to_thread(pair.destroy)
        result.seconds = time.monotonic() - started


async def _measure(world: World, block: Workload) -> tuple[Throughput, PublishLog]:
    """The consumers' throughput on ``block``: published while they are SIGSTOPped (at most
    :data:`HOLD_AT_MOST`), so that it waits for them whole, then how long from their SIGCONT to
    the last innocent event's receipt, and their CPU time meanwhile. Published with the consumers
    running, the measure would be the producer's: publisher confirms from a quorum queue on this
    machine come at a few hundred a second, a fraction of what two consumers apply."""
    innocents = [event.event_id for event in block.of_kind(Kind.APPLIED) if event.event_id]
    deadline = time.monotonic() + BLOCK_TIMEOUT
    producer = ResilientProducer(world.env.amqp_url, world.env.settings().exchange)
    held = world.pids()
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        publishing = asyncio.create_task(
            producer.publish_all(block.publications, rate=BLOCK_RATE, deadline=deadline)
        )
        await asyncio.wait({publishing}, timeout=HOLD_AT_MOST)
    finally:
        for pid in held:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    before = {pid: cpu for pid in world.pids() if (cpu := cpu_seconds(pid)) is not None}
    started = time.monotonic()
    if not publishing.done():
        world.notes.append(
            f"block {block.events[0].key[0]}: still publishing {HOLD_AT_MOST:.0f}s after the "
            "consumers were stopped: its throughput counts the rest of its publishing"
        )
    log = await publishing
    await _until_applied(world.env.database_url, innocents, deadline)
    seconds = time.monotonic() - started
    after = {pid: cpu for pid in world.pids() if (cpu := cpu_seconds(pid)) is not None}
    return Throughput(len(innocents), seconds, cpu_used(before, after)), log


def _rate(block: Throughput) -> str:
    return (
        f"{block.innocents} innocents in {block.seconds:.2f}s ({block.per_second:.0f}/s), "
        f"{block.per_cpu_second:.0f} per consumer CPU-second"
    )


async def _until_applied(dsn: str, event_ids: list[uuid.UUID], deadline: float) -> None:
    """Until every one of ``event_ids`` has a receipt, or ``deadline`` (then the checks say
    which are missing)."""
    conn = await asyncpg.connect(dsn, timeout=10)
    try:
        while time.monotonic() < deadline:
            found = await conn.fetchval(
                "SELECT count(DISTINCT event_id) FROM receipts WHERE event_id = ANY($1::uuid[])",
                event_ids,
            )
            if found >= len(set(event_ids)):
                return
            await asyncio.sleep(0.05)
    finally:
        await conn.close()


def _relays_idle(world: World, verdict: Verdict) -> list[str]:
    """Where several replicas must relay side by side: each one's rows published (the last
    scrape of each of its processes), in a note; a consumer whose relay published none is a
    violation."""
    published = world.relay_published()
    verdict.notes.append(
        "outbox rows published by each consumer's relay: "
        + ", ".join(f"consumer-{index} {count:.0f}" for index, count in sorted(published.items()))
    )
    return [
        f"consumer-{index}'s relay published no row"
        for index in range(len(world.services))
        if not published.get(index)
    ]


def _broken_links(world: World) -> list[str]:
    """Where no fault touches the broker: every lost connection and every redelivery."""
    losses = world.broker_losses()
    found = [f"a consumer lost RabbitMQ {count}x: {error}" for error, count in losses.items()]
    if redelivered := world.redeliveries():
        found.append(f"deliveries came back redelivered: {redelivered}")
    return found


async def _inject(
    world: World, scenario: Scenario, workload: Workload, gates: Gates, deadline: float
) -> list[FaultRecord]:
    """Each fault once its share of the effects is applied; then its gate opens."""
    records: list[FaultRecord] = []
    fault: Fault
    for gate, (share, fault) in enumerate(scenario.schedule()):
        on_time = await _wait_for_share(
            world, math.ceil(share * workload.effects_due), gates.reached[gate], deadline
        )
        applied_at = world.progress.applied
        began = time.monotonic()
        _say(f"  {fault.label} at {applied_at} applied")
        if getattr(fault, "needs_stream", False):
            gates.open(gate)  # it waits for events to flow (faults.RelayKill)
        await fault.inject(world)
        gates.open(gate)
        records.append(
            FaultRecord(fault.label, share, applied_at, on_time, time.monotonic() - began)
        )
    return records


async def _wait_for_share(world: World, target: int, held: asyncio.Event, deadline: float) -> bool:
    """Until ``target`` effects are applied (True); False if the stream has waited at the gate
    for :data:`GATE_GRACE` seconds, or ``deadline`` passed, first."""
    held_since: float | None = None
    while world.progress.applied < target:
        now = time.monotonic()
        if held.is_set():
            held_since = held_since or now
            if now - held_since > GATE_GRACE:
                return False
        if now > deadline:
            return False
        await asyncio.sleep(0.05)
    return True


async def _settle(
    world: World, workload: Workload, log: PublishLog, *, timeout: float
) -> str | None:
    """Wait until every effect is in, every expected dead letter is there, the work and delay
    queues hold nothing ready and no consumer holds a delivery, twice in a row; or until nothing
    has moved for :data:`QUIET_FOR` seconds with the queues empty; or ``timeout``. None when
    settled. (The consumers' ``consumer_in_flight`` only tells when to stop waiting: the checks
    afterwards count what is left in the queues once the consumers have stopped.)"""
    queues = table.broker_queues(world.env)
    busy_queues = queues.busy
    dead_bound = {p.message_id for p in workload.publications if not p.event.kind.applies}
    expected_dead = sum(
        1
        for attempt, outcome in log.attempts.items()
        if outcome is Attempt.CONFIRMED and attempt.split("~")[0] in dead_bound
    )
    probe = QueueProbe(world.env.amqp_url)
    deadline = time.monotonic() + timeout
    last: tuple[int, int, int] | None = None
    changed = time.monotonic()
    settled_polls = 0
    try:
        while time.monotonic() < deadline:
            await world.revive_crashed()
            dead_queues = list(queues.dead.values())
            depths = [await probe.ready(queue) for queue in [*busy_queues, *dead_queues]]
            if any(depth is None for depth in depths):
                await asyncio.sleep(0.5)
                continue
            busy = sum(depth or 0 for depth in depths[: len(busy_queues)])
            busy += await world.in_flight()
            if workload.effects_due > workload.to_apply:
                # Follow-ups owed by the relays are work too: not yet in any queue.
                owed = await _owed_rows(world.env.database_url)
                if owed is None:
                    await asyncio.sleep(0.5)
                    continue
                busy += owed
            dead = sum(depth or 0 for depth in depths[len(busy_queues) :])
            applied = world.progress.applied
            if busy == 0 and applied >= workload.effects_due and dead >= expected_dead:
                settled_polls += 1
                if settled_polls >= 2:
                    return None
            else:
                settled_polls = 0
            now = (busy, dead, applied)
            if now != last:
                last, changed = now, time.monotonic()
            elif busy == 0 and time.monotonic() - changed > QUIET_FOR:
                return (
                    f"stopped waiting: queues empty and nothing moved for {QUIET_FOR:.0f}s with "
                    f"{applied} of {workload.effects_due} effects and {dead} of {expected_dead} "
                    "dead"
                )
            await asyncio.sleep(0.3)
    finally:
        await probe.close()
    return f"not settled within {timeout:.0f}s"


async def _owed_rows(dsn: str) -> int | None:
    """Outbox rows neither sent nor failed; None while the database cannot say."""
    try:
        conn = await asyncpg.connect(dsn, timeout=5)
    except Exception:
        return None
    try:
        return int(
            await conn.fetchval(
                "SELECT count(*) FROM outbox WHERE sent_at IS NULL AND failed_at IS NULL",
                timeout=5,
            )
        )
    except Exception:
        return None
    finally:
        conn.terminate()


def _busy_queues(env: TestEnv) -> list[str]:
    return table.broker_queues(env).busy


async def _queue_by_queue(
    world: World,
    scenario: Scenario,
    workload: Workload,
    log: PublishLog,
    state: EndState,
    verdict: Verdict,
) -> list[str]:
    """The checks queue by queue (violations into ``verdict``), and each queue's commits a
    second before, during and after the faulty queue's trouble (notes, not invariants)."""
    env = world.env
    queues = table.read_table(env)
    assert queues is not None
    table.by_queue_checked(workload, state, verdict, queues, scenario.faulty_queue)
    if not scenario.mix_in:
        return []  # no trouble in any queue: no rates around it
    stretch = await table.trouble_of(env.database_url, workload, set(scenario.mix_in))
    if stretch is None:
        return ["the faulty queue's events were never called: no throughput around them"]
    rates = await table.throughput_around(env.database_url, env.name, queues, stretch)
    lines = table.describe_throughput(rates, stretch, scenario.faulty_queue)
    return lines + await _isolation(world, scenario, workload, log, queues, verdict)


async def _isolation(
    world: World,
    scenario: Scenario,
    workload: Workload,
    log: PublishLog,
    queues: QueueTable,
    verdict: Verdict,
) -> list[str]:
    """What the faulty queue's crash loops cost the other queues (notes), and a violation for
    each process without the faulty queue that ended by itself: process isolation's promise."""
    for index, names in enumerate(world.queues_of):
        if scenario.faulty_queue not in names.split(",") and world.restarted[index]:
            verdict.violations.append(
                f"consumer-{index} (--queues {names}) exited by itself and was restarted "
                f"{world.restarted[index]}x: queue {scenario.faulty_queue}'s trouble reached it"
            )
    crashes = await table.trouble_of(world.env.database_url, workload, {Kind.CRASH})
    if crashes is None:
        return []
    windows = await table.isolation(
        world.env.database_url,
        world.env.name,
        queues,
        workload,
        log.confirmed_at,
        crashes,
        scenario.faulty_queue,
    )
    hosts = {label: world.hosts(label) for label in queues.names}
    restarts = {label: sum(world.restarted[i] for i in hosts[label]) for label in queues.names}
    processes = {label: ", ".join(f"consumer-{i}" for i in hosts[label]) for label in queues.names}
    return table.describe_isolation(windows, crashes, scenario.faulty_queue, restarts, processes)


async def _shard_findings(
    cluster: ThrowawayRabbitCluster,
    world: World,
    workload: Workload,
    placed: shards.Placement,
    keys: dict[str, str],
    state: EndState,
    sent_at: dict[str, float],
) -> list[str]:
    """A sharded queue's figures (notes; a shard with no publication is a violation): where the
    hash ring put the events at the start and at the end, the dead copies' shards against it, the
    shard leaders struck and moved, and each shard's pause after the strike."""
    queues = table.broker_queues(world.env)
    [exchange] = queues.hash.values()
    notes: list[str] = []
    try:
        await shards.place(cluster, exchange, queues.shards, workload, keys, placed)
    except (RuntimeError, subprocess.SubprocessError) as error:
        notes.append(f"the hash ring's placement at the end unknown: {error}")
    found, violations = shards.placement_findings(placed, workload, state.dead)
    notes += found
    world.violations += violations
    if world.strike is not None:
        after = await asyncio.to_thread(cluster.leaders_of, queues.shards)
        names = [node.node for node in cluster.nodes]
        notes.append(shards.describe_strike(world.strike, after, names))
        notes.append(
            await shards.pauses(
                world.env.database_url, world.env.name, placed, workload, world.strike, sent_at
            )
        )
    return notes


async def _count_leftovers(env: TestEnv, state: EndState) -> None:
    """Messages in the work and delay queues once the consumers have stopped (whatever they held
    is back in the queue by then). Passive declares: ``rabbitmqctl list_queues`` shows quorum
    queues' statistics, which lag by seconds."""
    probe = QueueProbe(env.amqp_url)
    try:
        await asyncio.sleep(0.5)
        for queue in _busy_queues(env):
            state.leftovers[queue] = await probe.ready(queue) or 0
        if any(state.leftovers.values()):
            await asyncio.sleep(3)
            state.leftover_samples += [
                f"3s later: {queue}={await probe.ready(queue)}" for queue in state.leftovers
            ]
            for queue, count in state.leftovers.items():
                if count:
                    await sample_messages(env.amqp_url, queue, state)
    finally:
        await probe.close()


async def _stranded(cluster: ThrowawayRabbitCluster, env: TestEnv, world: World) -> None:
    """Note what the cluster's queues still hold for their at-least-once dead-letter workers at
    the end (after the runbook's step, if it was needed): expired retry copies or rejected
    messages RabbitMQ has not forwarded. The checks, which see only ready messages, count the
    events held there as lost; this says where they are."""
    busy = _busy_queues(env)
    unknown: list[str] = []
    held_at_end = await held_back(cluster, busy, unknown)
    world.notes += unknown
    for queue, held in held_at_end.items():
        world.notes.append(
            f"{queue}: RabbitMQ still holds {held} messages in its at-least-once dead-lettering "
            "at the end, not forwarded (not ready, so not 'left')"
        )
    if not held_at_end and not unknown:
        world.notes.append(
            f"at the end RabbitMQ held nothing for dead-lettering in any of the {len(busy)} work "
            f"and delay queues ({', '.join(q.removeprefix(env.name + '.') for q in busy)})"
        )


async def _remove_broker_objects(env: TestEnv) -> None:
    connection = await connect_any(env.amqp_url)
    try:
        channel = await connection.channel()
        for topology in env.topologies:
            for queue in topology.queues:
                await channel.queue_delete(queue.name)
            for exchange in topology.exchanges:
                await channel.exchange_delete(exchange.name)
    finally:
        await connection.close()
