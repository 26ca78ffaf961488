"""The pure parts of ``bench.shards``: which shards each process runs, the cells' ratios and
per-core figures, the scale model built on them, and the table (no broker, no database).

A cell is one measurement: ``processes`` service processes draining the same events from a
queue of ``shards`` shards. Its figures (a plain dict, as saved in the results' JSON):

- ``rate``: events a second in the measured window (``window``: the events committed at its
  start and end, ``window_s`` its length: from every process ready to the drain's tail);
  ``cpu``: percent of one core over that window for ``service`` (all its
  processes), ``beam`` (the three nodes) and each node (``beam0``..), ``postgres`` (the run
  database's backends, the harness's polling backend taken out), ``harness`` and ``machine``
  (percent of all cores);
- ``transactions``: the effect transactions (distinct receipts' transaction start times), so
  ``events / transactions`` is the events per commit the service reached;
- ``publish``: ``events``, ``seconds`` and ``cpu`` (the nodes' and the publisher's) of filling
  the backlog before the processes start.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "ScaleInputs",
    "assign_shards",
    "consumer_channels",
    "per_core",
    "ratios",
    "scale_inputs",
    "scale_model",
    "shard_lines",
]


def assign_shards(processes: int, shards: int) -> list[tuple[int, ...] | None]:
    """The shards each process runs (``consumer run --shards``); None: all of them (one process,
    or an unsharded queue that every process competes on).

    At least as many shards as processes: dealt round-robin (6 shards over 3 processes: 1,4 /
    2,5 / 3,6), every shard run by one process. Fewer shards than processes: each process runs
    one shard, dealt in turn (6 processes over 3 shards: 1 / 2 / 3 / 1 / 2 / 3), so two
    processes compete on each shard, as replicas beyond the shard count would.
    """
    if processes < 1 or shards < 1:
        raise ValueError("processes and shards must be at least 1")
    if shards == 1 or processes == 1:
        return [None] * processes
    if shards >= processes:
        return [
            tuple(shard for shard in range(1, shards + 1) if (shard - 1) % processes == index)
            for index in range(processes)
        ]
    return [((index % shards) + 1,) for index in range(processes)]


def consumer_channels(assignment: Sequence[tuple[int, ...] | None], shards: int) -> int:
    """The consumers (channels, each with its own prefetch window) all processes hold together:
    a process running every shard holds one per shard."""
    return sum(len(part) if part is not None else shards for part in assignment)


def shards_label(assignment: Sequence[tuple[int, ...] | None]) -> str:
    """``1,4 / 2,5 / 3,6``; ``all`` when every process runs every shard."""
    if all(part is None for part in assignment):
        return "all" if len(assignment) == 1 else f"all x{len(assignment)}"
    return " / ".join(",".join(map(str, part or ())) for part in assignment)


def _key(cell: Mapping[str, Any]) -> tuple[int, int]:
    return int(cell["processes"]), int(cell["shards"])


def ratios(cells: Sequence[Mapping[str, Any]]) -> dict[tuple[int, int], dict[str, float | None]]:
    """Per (processes, shards): its rate over the 1-shard rate at the same process count
    (``vs_one_shard``) and over 1 process x 1 shard's (``vs_one_by_one``); None where a rate is
    missing."""
    rates = {_key(cell): cell.get("rate") for cell in cells}
    base = rates.get((1, 1))
    out: dict[tuple[int, int], dict[str, float | None]] = {}
    for (processes, shards), rate in rates.items():
        same = rates.get((processes, 1))
        out[(processes, shards)] = {
            "vs_one_shard": rate / same if rate and same else None,
            "vs_one_by_one": rate / base if rate and base else None,
        }
    return out


def per_core(cell: Mapping[str, Any]) -> dict[str, float | None]:
    """One cell's figures per core and per event, from its rate, its CPU split and its
    transactions:

    - ``service_events_per_core_s``: events a second one fully busy service core applies
      (rate / (service CPU % / 100)); ``stack_events_per_core_s`` the same for the service, the
      nodes and PostgreSQL's backends together: on a machine whose cores others share, the cells
      differ mostly by how much CPU they were given, and this shows it;
    - ``beam_consume_ms``: the three nodes' CPU per event while draining (delivery, acks, the
      Raft log of the settlements on every replica), ``beam_publish_ms`` the same while the
      backlog was published (the enqueue and its replication), ``leader_node_ms`` the share of
      the node leading a one-shard queue (of the busiest node for more shards) while draining
      (``leader_node_publish_ms`` while publishing);
    - ``postgres_ms``: the run database's backends' CPU per event, ``postgres_commit_ms`` per
      effect transaction; ``events_per_commit``; ``commits_s``.
    """
    rate = cell.get("rate")
    cpu: Mapping[str, float] = cell.get("cpu") or {}
    if not rate:
        return {}
    transactions = cell.get("transactions")
    events = cell.get("events")
    per_commit = events / transactions if events and transactions else None

    def ms(percent: float | None) -> float | None:
        return None if percent is None else percent / 100 / rate * 1000

    service = cpu.get("service")
    leaders: Sequence[int] = cell.get("leaders") or []
    # A one-shard queue's leader's node (the publisher's node too); else the busiest node.
    leader = f"beam{leaders[0]}" if len(leaders) == 1 and leaders[0] >= 0 else None
    nodes = [value for label, value in cpu.items() if label.startswith("beam") and label[4:]]
    publish = cell.get("publish") or {}
    publish_cpu: Mapping[str, float] = publish.get("cpu") or {}
    publish_beam = publish_cpu.get("beam")
    publish_nodes = [
        v for label, v in publish_cpu.items() if label.startswith("beam") and label[4:]
    ]
    if leader is not None:
        nodes = [cpu.get(leader, 0.0)]
        publish_nodes = [publish_cpu.get(leader, 0.0)]
    publish_rate = publish["events"] / publish["seconds"] if publish.get("seconds") else None

    def publish_ms(percent: float | None) -> float | None:
        return percent / 100 / publish_rate * 1000 if percent and publish_rate else None

    postgres = ms(cpu.get("postgres"))
    stack = sum(cpu.get(group) or 0.0 for group in ("service", "beam", "postgres"))
    return {
        "service_events_per_core_s": rate / (service / 100) if service else None,
        "stack_events_per_core_s": rate / (stack / 100) if stack else None,
        "beam_consume_ms": ms(cpu.get("beam")),
        "beam_publish_ms": publish_ms(publish_beam),
        "leader_node_ms": ms(max(nodes)) if nodes else None,
        "leader_node_publish_ms": publish_ms(max(publish_nodes)) if publish_nodes else None,
        "postgres_ms": postgres,
        "postgres_commit_ms": postgres * per_commit if postgres and per_commit else None,
        "events_per_commit": per_commit,
        "commits_s": rate / per_commit if per_commit else None,
    }


@dataclass(frozen=True, slots=True)
class ScaleInputs:
    """The measured figures the scale model stands on (medians over the cells)."""

    service_events_per_core_s: float
    beam_ms_per_event: float
    """The cluster's CPU per event, publish side and consume side, all three replicas."""
    leader_node_ms: float
    """The CPU per event of the node leading a one-shard queue (which the publisher was connected
    to as well), publishing plus draining: what one leader's node spends per event, an upper
    bound on the queue's own Raft process."""
    postgres_ms: float
    events_per_commit: float


def _median(values: Sequence[float | None]) -> float | None:
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def scale_inputs(cells: Sequence[Mapping[str, Any]]) -> ScaleInputs | None:
    """The medians over ``cells`` of their per-core figures; the leader's node from the
    one-shard cells; None if a figure is missing."""
    figures = [per_core(cell) for cell in cells]
    service = _median([f.get("service_events_per_core_s") for f in figures])
    consume = _median([f.get("beam_consume_ms") for f in figures])
    publish = _median([f.get("beam_publish_ms") for f in figures])
    one_shard = [per_core(cell) for cell in cells if int(cell["shards"]) == 1]
    leader = _median([f.get("leader_node_ms") for f in one_shard])
    leader_publish = _median([f.get("leader_node_publish_ms") for f in one_shard])
    postgres = _median([f.get("postgres_ms") for f in figures])
    per_commit = _median([f.get("events_per_commit") for f in figures])
    if (
        service is None
        or consume is None
        or publish is None
        or leader is None
        or leader_publish is None
        or postgres is None
        or per_commit is None
    ):
        return None
    return ScaleInputs(
        service_events_per_core_s=service,
        beam_ms_per_event=consume + publish,
        leader_node_ms=leader + leader_publish,
        postgres_ms=postgres,
        events_per_commit=per_commit,
    )


def _up(value: float) -> int:
    """Rounded up, a float's last-digit noise aside (70.00000000001 is 70)."""
    return math.ceil(round(value, 6))


def scale_model(
    inputs: ScaleInputs, *, target: float = 100_000, headroom: float = 0.7, node_cores: int = 8
) -> list[tuple[str, float]]:
    """What ``target`` events a second would take, step by step: each step's name (with its
    arithmetic) and its figure. ``headroom``: the share of a core planned busy (0.7: 30% spare
    for bursts, redeliveries and failover); ``node_cores``: cores per RabbitMQ node."""
    if not 0 < headroom <= 1 or target <= 0 or node_cores < 1:
        raise ValueError("headroom in (0, 1], target and node_cores positive")
    service_cores = target / inputs.service_events_per_core_s / headroom
    processes = _up(service_cores)
    leader_events_s = 1000 / inputs.leader_node_ms * headroom
    shards_for_leaders = _up(target / leader_events_s)
    shards = max(shards_for_leaders, processes)
    broker_cores = target * inputs.beam_ms_per_event / 1000 / headroom
    nodes = max(3, _up(broker_cores / node_cores), _up(shards / node_cores))
    commits_s = target / inputs.events_per_commit
    postgres_cores = target * inputs.postgres_ms / 1000 / headroom
    t, h = f"{target:,.0f}", f"{headroom:g}"
    return [
        (
            f"service cores = {t} / {inputs.service_events_per_core_s:,.0f} events/s per core "
            f"/ {h}",
            service_cores,
        ),
        ("service processes (one asyncio process uses at most one core)", processes),
        (
            f"events/s one leader takes = 1000 ms / {inputs.leader_node_ms:.3f} ms per event x {h}",
            leader_events_s,
        ),
        (f"shards for the leaders = {t} / {leader_events_s:,.0f}, rounded up", shards_for_leaders),
        (
            "shards = max(that, processes): one process per shard keeps each key's order",
            shards,
        ),
        (
            f"RabbitMQ cores (3 replicas) = {t} x {inputs.beam_ms_per_event:.3f} ms / 1000 / {h}",
            broker_cores,
        ),
        (
            f"RabbitMQ nodes of {node_cores} cores = max(3, cores / {node_cores}, "
            f"shards / {node_cores} for one leader per node-core)",
            nodes,
        ),
        (
            f"PostgreSQL commits/s = {t} / {inputs.events_per_commit:.1f} events per commit",
            commits_s,
        ),
        (
            f"PostgreSQL backend cores = {t} x {inputs.postgres_ms:.3f} ms / 1000 / {h}",
            postgres_cores,
        ),
    ]


def _num(value: float | None, digits: int = 0) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def shard_lines(result: Mapping[str, Any]) -> list[str]:
    """The printed table: a row per cell, then the per-core figures and the scale model."""
    cells: Sequence[Mapping[str, Any]] = result.get("cells", [])
    relative = ratios(cells)
    lines = [
        f"shards x processes on a three-node cluster: {result.get('events', 0):,} "
        f"inventory.reserve events over {result.get('skus', 0):,} keys, {result.get('machine')}",
        "",
        "| processes | shards | --shards | events/s | vs 1 shard | vs 1x1 | service % | "
        "beam % | postgres % | machine % | svc events/s/core | all events/s/core | "
        "events/commit | load |",
        "|---:|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for cell in cells:
        key = _key(cell)
        if cell.get("error"):
            lines.append(f"| {key[0]} | {key[1]} | FAILED: {str(cell['error'])[:120]} |")
            continue
        cpu = cell.get("cpu") or {}
        core = per_core(cell)
        load = cell.get("load") or []
        lines.append(
            f"| {key[0]} | {key[1]} | {shards_label(assign_shards(*key))} | "
            f"{_num(cell.get('rate'))} | "
            f"{_num(relative[key]['vs_one_shard'], 2)} | {_num(relative[key]['vs_one_by_one'], 2)}"
            f" | {_num(cpu.get('service'))} | {_num(cpu.get('beam'))} | "
            f"{_num(cpu.get('postgres'))} | {_num(cpu.get('machine'))} | "
            f"{_num(core.get('service_events_per_core_s'))} | "
            f"{_num(core.get('stack_events_per_core_s'))} | "
            f"{_num(core.get('events_per_commit'), 1)} | "
            f"{' -> '.join(f'{value:.1f}' for value in load)} |"
        )
    inputs = scale_inputs([cell for cell in cells if not cell.get("error")])
    if inputs is None:
        return lines
    lines += [
        "",
        "Per core (medians over the cells): "
        f"{inputs.service_events_per_core_s:,.0f} events/s per service core; RabbitMQ "
        f"{inputs.beam_ms_per_event:.3f} ms of CPU per event (3 replicas, publish + drain), "
        f"a one-shard leader's node {inputs.leader_node_ms:.3f} ms; PostgreSQL backends "
        f"{inputs.postgres_ms:.3f} ms per event at {inputs.events_per_commit:.1f} events per "
        "commit.",
        "",
        "Scale model (100,000 events/s, 70% busy, 8-core nodes):",
    ]
    lines += [f"- {step}: {value:,.1f}" for step, value in scale_model(inputs)]
    return lines
