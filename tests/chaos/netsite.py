"""The network-fault scenarios' site (issue 35): a :class:`~tests.chaos.network.Lab` whose hosts
run a throwaway PostgreSQL, a throwaway RabbitMQ node, the service's processes and the runner
itself, each in a namespace of its own on its own ``10.77.0.<n>`` address.

- ``postgres``: ``initdb`` in a folder of its own, run as the ``postgres`` user, listening on its
  lab address only (every lab address trusted: the namespace is the fence);
- ``rabbit``: a node of its own (``RABBITMQ_NODENAME``, ports, data folders owned by
  ``rabbitmq``), its epmd on the namespace's own loopback;
- ``service``: the ``python -m consumer run`` processes (``ip netns exec``), their HTTP endpoint on
  the host's lab address;
- ``tester``: the runner's own sockets (producer, probes, checks) and the ``dlq`` subprocess: the
  runner's thread enters this namespace for the scenario (:meth:`Lab.entered`), so a cut between
  the service and a server leaves the runner's view alone;
- ``proxy``: where a scenario's latency proxy runs, between the service and the servers.

``net_site(cluster=True)`` puts a three-node RabbitMQ cluster there instead of the one node, each
node on a host of its own (``rabbit-1``..``rabbit-3``): named by its lab address (Erlang long
names), its epmd listening there, partitions handled by ``pause_minority``, and Erlang's
``net_ticktime`` at :data:`NET_TICKTIME` so a node cut off from its peers learns of it in seconds
(the default 60s would outlast a scenario). A cut between one node and the other two, leaving the
service's link to it up, is a partition (``net-node-partition``).

Leaving :func:`net_site`, however it ends, stops the servers, then the lab kills whatever is
left in its namespaces (epmd, a backend) and deletes them.
"""

from __future__ import annotations

import asyncio
import contextlib
import subprocess
import sys
from collections.abc import AsyncIterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from tests.chaos.network import Lab
from tests.servers import ThrowawayPostgres, ThrowawayRabbit, ThrowawayRabbitCluster
from tests.support import REPO

__all__ = ["CLUSTER_HOSTS", "HOSTS", "NET_TICKTIME", "NetSite", "from_tester", "net_site"]

HOSTS = ("tester", "service", "postgres", "rabbit", "proxy")
NODES = ("rabbit-1", "rabbit-2", "rabbit-3")
CLUSTER_HOSTS = ("tester", "service", "postgres", *NODES)
NET_TICKTIME = 10
"""Seconds: Erlang's ``net_ticktime`` on the lab cluster's nodes. A peer silent for between 1 and
1.25 times this is taken for down (the default, 60, would outlast the scenario's cut)."""
CLUSTER_CONFIG = ("loopback_users.guest = false", "cluster_partition_handling = pause_minority")
"""The lab cluster's ``rabbitmq.conf``: a node in the minority stops serving (closes its client
connections, stops its listeners) until it sees the majority again, the usual choice beside quorum
queues. The other cluster scenarios keep RabbitMQ's default (``ignore``)."""
PROXY_AMQP_PORT = 5672
PROXY_PG_PORT = 5432
"""The proxy's ports, on its own host (a namespace: nothing else listens there)."""
OPEN_HBA = "local all all trust\nhost all all 0.0.0.0/0 trust\n"
"""Every client trusted: only the lab's hosts can reach the server's address."""


@dataclass
class NetSite:
    lab: Lab
    rabbit: ThrowawayRabbit
    """The RabbitMQ node (with a cluster: its first)."""
    postgres: ThrowawayPostgres
    cluster: ThrowawayRabbitCluster | None = None
    """The three nodes, where the site has a cluster; node ``n`` (from 0) is host
    ``rabbit-<n + 1>``."""

    def launcher(self, host: str = "service") -> list[str]:
        """argv to put in front of a command that must run on ``host``."""
        return ["ip", "netns", "exec", self.lab.host(host).namespace]

    def address(self, host: str) -> str:
        return self.lab.host(host).address

    def start_proxy(self, control: Path) -> subprocess.Popen[bytes]:
        """The latency proxy (:mod:`tests.chaos.proxy`) on the ``proxy`` host, forwarding
        :data:`PROXY_AMQP_PORT` to RabbitMQ and :data:`PROXY_PG_PORT` to PostgreSQL, its delay
        read from ``control``; ended with the lab if not before."""
        control.write_text("0 0")
        return self.lab.start(
            "proxy",
            [
                "env", f"PYTHONPATH={REPO}", sys.executable, "-m", "tests.chaos.proxy",
                "--control", str(control),
                "--route", f"{PROXY_AMQP_PORT}:{self.address('rabbit')}:{self.rabbit.port}",
                "--route", f"{PROXY_PG_PORT}:{self.address('postgres')}:{self.postgres.port}",
            ],
        )  # fmt: skip

    def proxied_amqp_url(self) -> str:
        return f"amqp://guest:guest@{self.address('proxy')}:{PROXY_AMQP_PORT}/"

    def proxied_dsn(self, database: str) -> str:
        return f"postgresql://postgres@{self.address('proxy')}:{PROXY_PG_PORT}/{database}"

    @property
    def log(self) -> Path:
        """The lab PostgreSQL's server log."""
        return self.postgres.base / "log"


def _start_postgres(postgres: ThrowawayPostgres) -> None:
    postgres.init()
    postgres.start()


@contextlib.asynccontextmanager
async def net_site(*, cluster: bool = False) -> AsyncIterator[NetSite]:
    """The lab with its servers up (``cluster``: three RabbitMQ nodes, one host each, instead of
    one); everything stopped and deleted on the way out."""
    async with Lab(CLUSTER_HOSTS if cluster else HOSTS) as lab:
        nodes: ThrowawayRabbitCluster | None = None
        if cluster:
            nodes = ThrowawayRabbitCluster(
                hosts=[(lab.host(n).namespace, lab.host(n).address) for n in NODES],
                config=CLUSTER_CONFIG,
                erl_args=f"-kernel net_ticktime {NET_TICKTIME}",
            )
            rabbit = nodes.nodes[0]
        else:
            rabbit = ThrowawayRabbit(
                # guest may log in from other hosts than the node's: only the lab's reach it
                ["loopback_users.guest = false"],
                netns=lab.host("rabbit").namespace,
                address=lab.host("rabbit").address,
            )
        postgres = ThrowawayPostgres(
            netns=lab.host("postgres").namespace,
            address=lab.host("postgres").address,
            hba=OPEN_HBA,
        )
        try:
            await asyncio.gather(
                asyncio.to_thread(rabbit.start if nodes is None else nodes.start),
                asyncio.to_thread(_start_postgres, postgres),
            )
            yield NetSite(lab, rabbit, postgres, nodes)
        finally:
            await asyncio.gather(
                asyncio.to_thread(rabbit.destroy if nodes is None else nodes.destroy),
                asyncio.to_thread(postgres.destroy),
                return_exceptions=True,
            )


@contextlib.asynccontextmanager
async def from_tester(site: NetSite | None) -> AsyncIterator[None]:
    """The runner on the lab's ``tester`` host for the block (nothing if ``site`` is None): this
    thread in its namespace, and the loop's default executor a fresh one whose threads, started
    from here, are there too. Afterwards the old executor is back, its threads never having
    entered: the run's other servers are reached from the machine's own namespace as before."""
    if site is None:
        yield
        return
    loop = asyncio.get_running_loop()
    previous = getattr(loop, "_default_executor", None)
    executor = ThreadPoolExecutor(thread_name_prefix="lab-tester")
    try:
        with site.lab.entered("tester"):
            loop.set_default_executor(executor)
            try:
                yield
            finally:
                loop._default_executor = previous  # type: ignore[attr-defined]
    finally:
        executor.shutdown(wait=False, cancel_futures=True)
