"""The network-fault harness's ground (issue 35): hosts in network namespaces of their own, one
link each to a hub, and silent cuts between any two, in one direction or both.

Each host is a namespace (``<tag>-<host>``) with one veth end (``eth0``, ``10.77.0.<n>/24``) whose
other end is on a bridge in the hub namespace (``<tag>-hub``). Both ends of every veth are made
directly inside their namespaces, so the machine's own namespace never gets an interface, an
address or a rule: the harness cannot touch its services. A cut is an nftables drop rule in the
sending host's namespace (``output``: the packets never leave, no RST, no ICMP: a firewall that
drops silently), so the peers learn of it only from their own timeouts.

:class:`Lab` is an ``async with`` block: whatever happens inside, leaving it ends every process it
started (by process group) and deletes every namespace it made, which takes their interfaces and
rules along. :func:`leftovers` lists what a tag left behind: the tests check it is nothing.
Needs root, ``ip`` (iproute2) and ``nft`` (Debian's nftables).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Literal

__all__ = ["Host", "Lab", "leftovers"]

SUBNET = "10.77.0"
Direction = Literal["both", "to", "from"]
CLONE_NEWNET = 0x40000000
NETNS_DIR = "/run/netns"


def _setns(fd: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, CLONE_NEWNET) != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"setns: {os.strerror(error)}")


def _run(*argv: str) -> str:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(argv)}: {done.stderr.strip() or done.returncode}")
    return done.stdout


@dataclass(frozen=True)
class Host:
    name: str
    namespace: str
    address: str


@dataclass
class Lab:
    """Hosts in namespaces of their own, linked through a hub; see the module docstring."""

    hosts: Sequence[str]
    tag: str = field(default_factory=lambda: f"nf{uuid.uuid4().hex[:8]}")
    made: list[str] = field(default_factory=list, init=False)
    processes: list[subprocess.Popen[bytes]] = field(default_factory=list, init=False)
    by_name: dict[str, Host] = field(default_factory=dict, init=False)

    @property
    def hub(self) -> str:
        return f"{self.tag}-hub"

    async def __aenter__(self) -> Lab:
        try:
            self._build()
        except BaseException:
            self.tear_down()
            raise
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.tear_down()

    def _namespace(self, name: str) -> None:
        _run("ip", "netns", "add", name)
        self.made.append(name)
        _run("ip", "-n", name, "link", "set", "lo", "up")

    def _build(self) -> None:
        self._namespace(self.hub)
        _run("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        _run("ip", "-n", self.hub, "link", "set", "br0", "up")
        for number, name in enumerate(self.hosts, start=1):
            namespace = f"{self.tag}-{name}"
            self._namespace(namespace)
            port = f"p{number}"
            # Both ends made inside their namespaces: never an interface in the machine's own.
            _run(
                "ip", "-n", self.hub, "link", "add", port, "type", "veth",
                "peer", "name", "eth0", "netns", namespace,
            )  # fmt: skip
            _run("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
            address = f"{SUBNET}.{number}"
            _run("ip", "-n", namespace, "addr", "add", f"{address}/24", "dev", "eth0")
            _run("ip", "-n", namespace, "link", "set", "eth0", "up")
            _run("ip", "netns", "exec", namespace, "nft", "add", "table", "inet", "cut")
            _run(
                "ip", "netns", "exec", namespace, "nft", "add", "chain", "inet", "cut", "out",
                "{ type filter hook output priority 0 ; policy accept ; }",
            )  # fmt: skip
            _run(
                "ip", "netns", "exec", namespace, "nft", "add", "chain", "inet", "cut", "in",
                "{ type filter hook input priority 0 ; policy accept ; }",
            )  # fmt: skip
            # The peers a trigger rule has cut off (cut_at_commit): filled by the packet itself.
            _run(
                "ip", "netns", "exec", namespace, "nft", "add", "set", "inet", "cut", "armed",
                "{ type ipv4_addr ; flags dynamic ; }",
            )  # fmt: skip
            self.by_name[name] = Host(name, namespace, address)

    def host(self, name: str) -> Host:
        return self.by_name[name]

    def cut(self, a: str, b: str, direction: Direction = "both") -> None:
        """Drop, silently, what ``a`` sends to ``b`` (``to``), what ``b`` sends to ``a``
        (``from``), or both."""
        if direction in ("both", "to"):
            self._drop(self.host(a), self.host(b))
        if direction in ("both", "from"):
            self._drop(self.host(b), self.host(a))

    def cut_at_commit(
        self, client: str, server: str, port: int, lose: Literal["request", "reply"]
    ) -> None:
        """Arm a cut that the next ``COMMIT`` ``client`` sends ``server`` (PostgreSQL's simple
        query ``COMMIT;`` on ``port``) sets off, from that very packet on: ``request``, that
        packet and everything after it to ``server`` dropped (the COMMIT never arrives);
        ``reply``, the packet goes, and everything ``server`` sends back is dropped (it commits,
        the answer is lost). :meth:`triggered` says when it went off."""
        namespace = self.host(client).namespace
        nft = ("ip", "netns", "exec", namespace, "nft", "add", "rule", "inet", "cut")
        # The payload after the TCP header: 'Q', a 4-byte length, then the query's text.
        _run(
            *nft, "out", "ip", "daddr", self.host(server).address, "tcp", "dport", str(port),
            "@ih,40,48", "0x" + b"COMMIT".hex(), "add", "@armed", "{", "ip", "daddr", "}",
        )  # fmt: skip
        if lose == "request":
            _run(*nft, "out", "ip", "daddr", "@armed", "drop")
        else:
            _run(*nft, "in", "ip", "saddr", "@armed", "drop")

    def lose(self, name: str, percent: int) -> None:
        """Drop ``percent`` % of what host ``name`` sends, at random (until :meth:`heal`)."""
        _run(
            "ip", "netns", "exec", self.host(name).namespace, "nft", "add", "rule", "inet", "cut",
            "out", "numgen", "random", "mod", "100", "<", str(percent), "drop",
        )  # fmt: skip

    def triggered(self, client: str) -> bool:
        """Whether a cut armed by :meth:`cut_at_commit` on ``client`` has gone off."""
        listed = _run(
            "ip", "netns", "exec", self.host(client).namespace, "nft", "list", "set", "inet",
            "cut", "armed",
        )  # fmt: skip
        return "elements" in listed

    def heal(self) -> None:
        """Every cut gone."""
        for host in self.by_name.values():
            for what in (("chain", "out"), ("chain", "in"), ("set", "armed")):
                _run(
                    "ip", "netns", "exec", host.namespace, "nft", "flush", *what[:1], "inet",
                    "cut", what[1],
                )  # fmt: skip

    def _drop(self, sender: Host, receiver: Host) -> None:
        _run(
            "ip", "netns", "exec", sender.namespace, "nft", "add", "rule", "inet", "cut", "out",
            "ip", "daddr", receiver.address, "drop",
        )  # fmt: skip

    def start(self, name: str, argv: Sequence[str]) -> subprocess.Popen[bytes]:
        """``argv`` in host ``name``'s namespace, in a process group of its own (ended on the way
        out)."""
        process = subprocess.Popen(
            ["ip", "netns", "exec", self.host(name).namespace, *argv],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            start_new_session=True,
        )
        self.processes.append(process)
        return process

    @contextlib.contextmanager
    def entered(self, name: str) -> Iterator[Host]:
        """The calling thread inside host ``name``'s namespace for the block, back in its own
        after it: the sockets it opens meanwhile (an asyncio loop's, on this thread) and the
        processes it starts live there. Threads started earlier stay where they were."""
        own = os.open("/proc/thread-self/ns/net", os.O_RDONLY)
        try:
            target = os.open(f"{NETNS_DIR}/{self.host(name).namespace}", os.O_RDONLY)
            try:
                _setns(target)
            finally:
                os.close(target)
            try:
                yield self.host(name)
            finally:
                _setns(own)
        finally:
            os.close(own)

    def tear_down(self) -> None:
        """End every process started and any other still in a namespace (a server that
        daemonized), delete every namespace made (their interfaces and rules go with them); safe
        to call twice."""
        for process in self.processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=10)
        self.processes.clear()
        for namespace in self.made:
            with contextlib.suppress(RuntimeError):
                for pid in _run("ip", "netns", "pids", namespace).split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
                        _reap(int(pid))
        for namespace in reversed(self.made):
            with contextlib.suppress(RuntimeError):
                _run("ip", "netns", "del", namespace)
        self.made.clear()


def _reap(pid: int, timeout: float = 10) -> None:
    """Until ``pid`` is gone (or a zombie: a daemon's parent may be gone too)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as stat:
                if stat.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return
        except OSError:
            return
        time.sleep(0.05)


def lab_namespaces() -> set[str]:
    """Every network namespace on the machine that a lab could have made (``<tag>-<host>``)."""
    return {line.split()[0] for line in _run("ip", "netns", "list").splitlines() if line.strip()}


def leftovers(tag: str) -> list[str]:
    """What ``tag`` left: namespaces, interfaces in the machine's own namespace, processes in a
    namespace of its (by ``ip netns pids``)."""
    found: list[str] = []
    for line in _run("ip", "netns", "list").splitlines():
        namespace = line.split()[0] if line.strip() else ""
        if namespace.startswith(f"{tag}-"):
            found.append(f"namespace {namespace}")
            with contextlib.suppress(RuntimeError):
                found += [
                    f"process {pid}" for pid in _run("ip", "netns", "pids", namespace).split()
                ]
    found += [
        f"interface {line.strip()}"
        for line in _run("ip", "-o", "link", "show").splitlines()
        if tag in line
    ]
    return found
