"""The network-fault harness's ground (tests/chaos/network.py): namespaces, links, silent cuts, and
a teardown that leaves no namespace, interface or process behind, even after a failure."""

from __future__ import annotations

import subprocess
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal

import aio_pika
import asyncpg
import pytest

from tests.chaos.netfaults import node_findings
from tests.chaos.netsite import from_tester, net_site
from tests.chaos.network import Lab, leftovers
from tests.chaos.world import Partition
from tests.servers import ThrowawayRabbit, port_open

PORT = "9000"
SERVER = (
    "import socket\n"
    "s = socket.create_server(('0.0.0.0', 9000))\n"
    "while True:\n"
    "    c, _ = s.accept()\n"
    "    c.sendall(c.recv(1))\n"
    "    c.close()\n"
)
PROBE = (
    "import socket, sys\n"
    "c = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[2]))\n"
    "c.sendall(b'x')\n"
    "assert c.recv(1) == b'x'\n"
)


COMMIT = b"Q\x00\x00\x00\x0cCOMMIT;\x00"
"""PostgreSQL's simple query ``COMMIT;``, as asyncpg sends it."""
SENDER = (
    "import socket, sys\n"
    "c = socket.create_connection((sys.argv[1], 9000), timeout=float(sys.argv[2]))\n"
    "c.sendall(bytes.fromhex(sys.argv[3]))\n"
    "print('sent', flush=True)\n"
    "assert c.recv(1)\n"
)


def probe(
    lab: Lab, source: str, target: str, timeout: float = 5, payload: bytes = b""
) -> subprocess.CompletedProcess[str]:
    """A TCP round trip from ``source`` to ``target``'s echo server (sending ``payload`` first
    instead of one byte, if given)."""
    script, extra = (SENDER, [payload.hex()]) if payload else (PROBE, [])
    return subprocess.run(
        ["ip", "netns", "exec", lab.host(source).namespace, sys.executable, "-c", script,
         lab.host(target).address, str(timeout), *extra],
        capture_output=True, text=True, check=False, timeout=60,
    )  # fmt: skip


def wait_for_server(lab: Lab, source: str, target: str) -> None:
    for _ in range(100):
        if probe(lab, source, target, timeout=1).returncode == 0:
            return
    raise AssertionError(f"the echo server in {target} never answered {source}")


async def test_a_cut_drops_silently_one_way_or_both_heals_and_leaves_nothing() -> None:
    async with Lab(["a", "b", "c"]) as lab:
        server = lab.start("a", [sys.executable, "-c", SERVER])
        wait_for_server(lab, "b", "a")

        # Cut between b and a, both ways: b's connect hears nothing (no RST, no ICMP): a timeout
        lab.cut("b", "a")
        cut = probe(lab, "b", "a", timeout=1)
        assert cut.returncode != 0
        assert "timed out" in cut.stderr, cut.stderr
        # c is not cut off
        assert probe(lab, "c", "a").returncode == 0

        # One way only (a's replies to c dropped): c's connect times out too, silently
        lab.cut("a", "c", "to")
        assert "timed out" in probe(lab, "c", "a", timeout=1).stderr

        lab.heal()
        assert probe(lab, "b", "a").returncode == 0
        assert probe(lab, "c", "a").returncode == 0
        tag = lab.tag

    assert server.poll() is not None
    assert leftovers(tag) == []


async def failing_scenario(lab: Lab, started: list[subprocess.Popen[bytes]]) -> None:
    async with lab:
        started.append(lab.start("a", ["sleep", "1000"]))
        lab.cut("a", "b")
        assert leftovers(lab.tag)  # there while it runs
        raise ZeroDivisionError("a scenario that fails part-way")


async def test_a_failed_scenario_still_leaves_no_namespace_interface_or_process() -> None:
    lab = Lab(["a", "b"])
    started: list[subprocess.Popen[bytes]] = []

    with pytest.raises(ZeroDivisionError):
        await failing_scenario(lab, started)

    assert started[0].poll() is not None
    assert leftovers(lab.tag) == []


async def test_the_lab_runs_its_servers_in_namespaces_and_leaves_nothing_behind() -> None:
    # Given the lab with its throwaway PostgreSQL and RabbitMQ node, each on its own host
    async with net_site() as site:
        tag = site.lab.tag
        # Then the runner reaches them from the tester host, by their lab addresses
        async with from_tester(site):
            conn = await asyncpg.connect(site.postgres.admin_dsn, timeout=10)
            assert await conn.fetchval("SELECT host(inet_server_addr())") == (
                site.address("postgres")
            )
            await conn.close()
            connection = await aio_pika.connect(site.rabbit.url, timeout=10)
            await connection.close()
        # and the machine's own namespace does not: nothing listens there for them
        assert not port_open(site.postgres.port)
        assert not port_open(site.rabbit.port)
        assert leftovers(tag)  # their namespaces and processes, while it runs

    # When it ends, no namespace, interface or process (epmd, a backend) is left
    assert leftovers(tag) == []


@pytest.mark.parametrize("lose", ["request", "reply"])
async def test_a_cut_armed_at_a_commit_goes_off_with_the_commit_and_not_before(
    lose: Literal["request", "reply"],
) -> None:
    async with Lab(["server", "client"]) as lab:
        lab.start("server", [sys.executable, "-c", SERVER])
        wait_for_server(lab, "client", "server")

        # Given a cut armed on the client's next COMMIT to the server
        lab.cut_at_commit(
            "client", "server", int(PORT), "request" if lose == "request" else "reply"
        )

        # Then other traffic goes through, and the trigger has not gone off
        assert probe(lab, "client", "server").returncode == 0
        assert not lab.triggered("client")

        # When a COMMIT goes: it sets the cut off, and no answer comes back (the request
        # dropped, or the reply)
        cut = probe(lab, "client", "server", timeout=1, payload=COMMIT)
        assert cut.returncode != 0
        assert "sent" in cut.stdout
        assert "timed out" in cut.stderr, cut.stderr
        assert lab.triggered("client")
        # and the server is cut off from the client from then on, until healed
        assert probe(lab, "client", "server", timeout=1).returncode != 0
        lab.heal()
        assert not lab.triggered("client")
        assert probe(lab, "client", "server").returncode == 0
        tag = lab.tag

    assert leftovers(tag) == []


def test_the_cut_nodes_log_tells_when_it_saw_its_peers_down_paused_and_saw_them_back(
    tmp_path: Path,
) -> None:
    node = ThrowawayRabbit(name="rc-1", address="10.77.0.4", long_name=True)
    node.base = tmp_path
    (tmp_path / "log").mkdir()
    before = "2026-12-03 20:18:59.000000+00:00 [info] <0.1.0> node 'rc-2@10.77.0.5' down: old\n"
    (tmp_path / "log" / "rc-1@10.77.0.4.log").write_text(
        before + "2026-12-03 20:19:11.400000+00:00 [info] <0.2.0> node 'rc-2@10.77.0.5' down: "
        "net_tick_timeout\n"
        "2026-12-03 20:19:11.500000+00:00 [warning] <0.3.0> Cluster minority/secondary status "
        "detected - awaiting recovery\n"
        "2026-12-03 20:20:04.000000+00:00 [info] <0.4.0> rabbit on node 'rc-2@10.77.0.5' up\n"
    )
    partition = Partition(
        "cut",
        datetime(2026, 12, 3, 20, 19, 0, tzinfo=UTC),
        healed_at=datetime(2026, 12, 3, 20, 20, 0, tzinfo=UTC),
    )

    said = node_findings(node, len(before), partition, datetime(2026, 12, 3, 20, 20, 7, tzinfo=UTC))

    assert said == (
        "node rc-1@10.77.0.4: peers down 11.4s after the cut, paused (pause_minority) 11.5s "
        "after the cut, back 4.0s after the heal; 3 running members 7.0s after the heal"
    )
    assert node.node == "rc-1@10.77.0.4"
    assert node._env["RABBITMQ_USE_LONGNAME"] == "true"
    assert node._env["ERL_EPMD_ADDRESS"] == "10.77.0.4"  # the peers ask it from their hosts
