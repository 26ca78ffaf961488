"""Throwaway RabbitMQ nodes and PostgreSQL clusters for tests that stop, restart or freeze a server.

Each runs on its own ports and data folders, as the user its package runs as, so a test can kill it
without touching the shared services other tests use.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Protocol

RABBITMQ_BIN = Path("/usr/lib/rabbitmq/bin")
RABBITMQ_HOME = Path("/var/lib/rabbitmq")


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def port_open(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex(("127.0.0.1", port)) == 0


def _as_user(
    user: str, argv: list[str], env: dict[str, str] | None = None, netns: str | None = None
) -> list[str]:
    """``argv`` as ``user`` (when root), with ``env`` set, in network namespace ``netns`` if
    given (the network-fault lab's hosts: :mod:`tests.chaos.network`)."""
    inside = ["ip", "netns", "exec", netns] if netns is not None else []
    prefix = ["runuser", "-u", user, "--"] if os.geteuid() == 0 else []
    assignments = [f"{key}={value}" for key, value in (env or {}).items()]
    return [*inside, *prefix, "env", *assignments, *argv]


class ThrowawayRabbit:
    """A RabbitMQ node of its own (``RABBITMQ_NODENAME``, ports and data folders).

    ``config`` lines (the attribute, read at each :meth:`start`) go into its ``rabbitmq.conf``;
    files they name (certificates, keys) can be put in the node's folder, readable by the
    rabbitmq user, with :meth:`add_file`.
    """

    def __init__(
        self,
        config: Sequence[str] = (),
        *,
        name: str | None = None,
        cookie: str | None = None,
        netns: str | None = None,
        address: str = "127.0.0.1",
        long_name: bool = False,
        erl_args: str = "",
    ) -> None:
        """``netns``: run in that network namespace (every command too), listening on
        ``address`` there (its epmd on the namespace's own loopback). ``long_name``: the node is
        ``<name>@<address>`` (Erlang long names), its epmd listening on ``address`` too, so nodes
        in other namespaces reach it there: a cluster whose nodes each have a host of their own.
        ``erl_args``: extra arguments to the node's Erlang VM (``-kernel net_ticktime 10``)."""
        host = address if long_name else "localhost"
        self.node = f"{name or 't' + uuid.uuid4().hex[:8]}@{host}"
        self.long_name = long_name
        self.erl_args = erl_args
        self.port = free_port()
        self.dist_port = free_port()
        self.netns = netns
        self.address = address
        # Under the rabbitmq user's home: Mnesia refuses some temporary file systems.
        self.base = RABBITMQ_HOME / f"throwaway-{self.node.split('@')[0]}"
        self.url = f"amqp://guest:guest@{address}:{self.port}/"
        self.config = list(config)
        self.cookie = cookie
        """The Erlang cookie of a cluster's nodes (and of their ``rabbitmqctl``): a ``HOME`` of
        the node's own holds it. None: the rabbitmq user's, shared with the machine's broker."""

    @property
    def _home(self) -> Path:
        return RABBITMQ_HOME if self.cookie is None else self.base / "home"

    @property
    def _env(self) -> dict[str, str]:
        base = self.base
        return {
            "HOME": str(self._home),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": self.address,
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(base / "pid"),
            # Long names: the other nodes ask this epmd from their own hosts (loopback is
            # implied).
            "ERL_EPMD_ADDRESS": self.address if self.long_name else "127.0.0.1",
            **({"RABBITMQ_USE_LONGNAME": "true"} if self.long_name else {}),
            **({"RABBITMQ_SERVER_ADDITIONAL_ERL_ARGS": self.erl_args} if self.erl_args else {}),
        }

    def _ctl(
        self, *args: str, check: bool = True, timeout: float = 60, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _as_user(
                "rabbitmq",
                [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node, *args],
                self._env,
                self.netns,
            ),
            capture_output=True,
            text=True,
            check=check,
            timeout=timeout,
            cwd="/",
            input=input_text,
        )

    def ctl_command(self) -> list[str]:
        """``rabbitmqctl`` for this node, as argv to put in front of a command's arguments."""
        return _as_user(
            "rabbitmq", [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node], self._env, self.netns
        )

    def _prepare(self) -> None:
        if self.base.exists():
            return
        for sub in ("mnesia", "log"):
            (self.base / sub).mkdir(parents=True)
        for name in ("rabbitmq.conf", "enabled_plugins", "rabbitmq-env.conf"):
            (self.base / name).write_text("")
        if self.cookie is not None:
            self._home.mkdir()
            cookie = self._home / ".erlang.cookie"
            cookie.write_text(self.cookie)
            cookie.chmod(0o400)  # Erlang refuses a cookie file others can read
        shutil.chown(self.base, "rabbitmq", "rabbitmq")
        for path in self.base.rglob("*"):
            shutil.chown(path, "rabbitmq", "rabbitmq")

    def add_file(self, name: str, source: Path, mode: int = 0o600) -> Path:
        """Copy ``source`` into the node's folder, owned by rabbitmq; the path to name in config."""
        self._prepare()
        target = self.base / name
        shutil.copyfile(source, target)
        shutil.chown(target, "rabbitmq", "rabbitmq")
        target.chmod(mode)
        return target

    def enable_plugins(self, *plugins: str) -> None:
        """Enable these plugins at the node's next start (its ``enabled_plugins`` file)."""
        self._prepare()
        target = self.base / "enabled_plugins"
        target.write_text(f"[{','.join(plugins)}].\n")
        shutil.chown(target, "rabbitmq", "rabbitmq")

    def start(self, timeout: float = 90) -> None:
        self._prepare()
        if self.config:
            (self.base / "rabbitmq.conf").write_text("".join(f"{line}\n" for line in self.config))
        subprocess.run(
            _as_user(
                "rabbitmq",
                [str(RABBITMQ_BIN / "rabbitmq-server"), "-detached"],
                self._env,
                self.netns,
            ),
            check=True,
            timeout=30,
            cwd="/",
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                started = self._ctl("await_startup", check=False, timeout=30).returncode == 0
            except subprocess.TimeoutExpired:  # a loaded machine: ask again until the deadline
                started = False
            # In a namespace the port is not on this one's loopback: await_startup must do.
            if started and (self.netns is not None or port_open(self.port)):
                return
            time.sleep(0.5)
        raise RuntimeError(f"RabbitMQ node {self.node} did not start; see {self.base / 'log'}")

    def stop(self) -> None:
        """Stop the node and wait until its process has exited (so its ports are free)."""
        self._ctl("stop", str(self.base / "pid"), check=False, timeout=120)

    def restart(self) -> None:
        self.stop()
        self.start()

    def beam_pid(self) -> int | None:
        """The node's Erlang VM, from its pid file (None when it is not running)."""
        try:
            pid = int((self.base / "pid").read_text().strip())
        except (OSError, ValueError):
            return None
        return pid if _running(pid) else None

    def signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the node's Erlang VM (SIGKILL: a crash; SIGSTOP/SIGCONT: a freeze)."""
        pid = self.beam_pid()
        if pid is None:
            raise RuntimeError(f"RabbitMQ node {self.node} is not running")
        os.kill(pid, sig)
        if sig == signal.SIGKILL:
            _wait_gone(pid)

    def close_all_connections(self) -> None:
        self._ctl("close_all_connections", "closed by a test")

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def restart_member_expression(queue: str, vhost: str = "/") -> str:
    """The ``rabbitmqctl eval`` of deploy/runbooks/DeadLetteringStuck.md, for one queue (run it
    on the queue's leader node). ``restart_server`` alone answers ``already_started`` for a
    running member: it must be stopped first."""
    return (
        f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"{vhost}">>, queue, <<"{queue}">>)), '
        "{RaName, _} = amqqueue:get_pid(Q), Member = {RaName, node()}, "
        "ok = rabbit_quorum_queue:stop_server(Member), "
        "rabbit_quorum_queue:restart_server(Member)."
    )


class ThrowawayRabbitCluster:
    """Three (by default) :class:`ThrowawayRabbit` nodes with one Erlang cookie, joined with
    ``rabbitmqctl join_cluster`` to the first.

    A node is named by its index. :attr:`urls` lists them all, the form ``CONSUMER_AMQP_URL``
    takes for a cluster.
    """

    def __init__(
        self,
        size: int = 3,
        *,
        hosts: Sequence[tuple[str, str]] = (),
        config: Sequence[str] = (),
        erl_args: str = "",
    ) -> None:
        """``hosts``: a ``(network namespace, address)`` per node, each node then on a host of
        its own and named by its address (long names: see :class:`ThrowawayRabbit`), as in the
        network-fault lab (:mod:`tests.chaos.network`); ``size`` is then their count.
        ``config``: every node's ``rabbitmq.conf`` lines; ``erl_args``: every node's VM's."""
        tag = f"rc{uuid.uuid4().hex[:6]}"
        cookie = uuid.uuid4().hex.upper()
        where: list[tuple[str | None, str]] = list(hosts) or [(None, "127.0.0.1")] * size
        self.nodes = [
            ThrowawayRabbit(
                config,
                name=f"{tag}-{n + 1}",
                cookie=cookie,
                netns=netns,
                address=address,
                long_name=bool(hosts),
                erl_args=erl_args,
            )
            for n, (netns, address) in enumerate(where)
        ]
        self.start_seconds: float | None = None
        """How long :meth:`start` took (all nodes up and joined)."""

    @property
    def urls(self) -> list[str]:
        return [node.url for node in self.nodes]

    @property
    def url_list(self) -> str:
        """The comma-separated list ``CONSUMER_AMQP_URL`` takes."""
        return ",".join(self.urls)

    def enable_plugins(self, *plugins: str) -> None:
        """Enable these plugins on every node, at its next start."""
        for node in self.nodes:
            node.enable_plugins(*plugins)

    def start(self) -> None:
        """Start every node (in parallel: each takes seconds) and join the others to the first."""
        began = time.monotonic()
        with ThreadPoolExecutor(len(self.nodes)) as pool:
            list(pool.map(ThrowawayRabbit.start, self.nodes))
        seed = self.nodes[0].node
        for node in self.nodes[1:]:
            node._ctl("stop_app")
            node._ctl("join_cluster", seed, timeout=120)
            node._ctl("start_app", timeout=120)
        self.await_members(len(self.nodes))
        self.start_seconds = time.monotonic() - began

    def await_members(self, count: int, timeout: float = 120) -> None:
        """Wait until the first live node sees ``count`` running members."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.running_members() >= count:
                return
            time.sleep(0.5)
        raise RuntimeError(f"the cluster does not have {count} running nodes")

    def running_members(self) -> int:
        for node in self.nodes:
            if node.beam_pid() is None:
                continue
            result = node._ctl("cluster_status", "--formatter", "json", check=False, timeout=30)
            if result.returncode == 0:
                return len(json.loads(result.stdout).get("running_nodes", []))
        return 0

    def kill(self, index: int) -> None:
        """SIGKILL the node's Erlang VM: a crash, no goodbye to the others."""
        self.nodes[index].signal(signal.SIGKILL)

    def stop(self, index: int) -> None:
        self.nodes[index].stop()

    def start_node(self, index: int) -> None:
        """Start a stopped or killed node again: it rejoins the cluster it was in."""
        self.nodes[index].start()

    def freeze(self, index: int) -> None:
        """SIGSTOP the node: to the others and to clients it stops answering (a partition)."""
        self.nodes[index].signal(signal.SIGSTOP)

    def thaw(self, index: int) -> None:
        self.nodes[index].signal(signal.SIGCONT)

    def connection_ports(self, name_part: str) -> set[int]:
        """The server ports (so the nodes) of the client connections whose name contains
        ``name_part`` (the service names its connections ``<name>/<role>@<host>:<pid>``)."""
        for node in self.nodes:
            if node.beam_pid() is None:
                continue
            result = node._ctl(
                *("list_connections", "port", "client_properties", "--formatter", "json"),
                check=False,
                timeout=30,
            )
            if result.returncode != 0:
                continue
            return {
                int(row["port"])
                for row in json.loads(result.stdout)
                if name_part in str(row.get("client_properties"))
            }
        raise RuntimeError("no live node lists the connections")

    def dead_letter_backlog(self, queue: str, vhost: str = "/") -> int:
        """Messages quorum queue ``queue`` holds for its at-least-once dead-letter worker
        (expired or rejected, not yet confirmed by the target): neither ready nor unacked, so
        invisible to a passive declare. From the Raft state of the first live node's member."""
        expression = (
            f'{{ok, Q}} = rabbit_amqqueue:lookup(rabbit_misc:r(<<"{vhost}">>, queue, '
            f'<<"{queue}">>)), {{Name, _}} = amqqueue:get_pid(Q), '
            "{ok, {_, O}, _} = ra:local_query({Name, node()}, fun rabbit_fifo:overview/1), "
            "maps:get(num_discarded, O, 0) + maps:get(num_discard_checked_out, O, 0)."
        )
        for node in self.nodes:
            if node.beam_pid() is None:
                continue
            result = node._ctl("eval", expression, check=False, timeout=30)
            if result.returncode == 0 and result.stdout.strip().isdigit():
                return int(result.stdout.strip())
        raise RuntimeError(f"no live node reports the dead-letter backlog of {queue}")

    def restart_leader_member(self, queue: str, vhost: str = "/") -> str:
        """The runbook's step for ``DeadLetteringStuck`` (deploy/runbooks): stop and start again
        quorum queue ``queue``'s Raft member on its leader node. A follower takes over and starts
        a fresh dead-letter worker, which takes back what the stuck one held. Returns what the
        ``eval`` printed (``ok`` when the member is back)."""
        leader = self.nodes[self.leader_of(queue, vhost)]
        result = leader._ctl("eval", restart_member_expression(queue, vhost), timeout=60)
        return result.stdout.strip()

    def index_of(self, node_name: str) -> int:
        return [node.node for node in self.nodes].index(node_name)

    def leader_of(self, queue: str, vhost: str = "/") -> int:
        """The index of the node that leads quorum queue ``queue``, asked of a live node."""
        return self.leaders_of([queue], vhost)[queue]

    def leaders_of(self, queues: Sequence[str], vhost: str = "/") -> dict[str, int]:
        """The index of the node leading each of ``queues`` (quorum queues), in one question to
        a live node."""
        for node in self.nodes:
            if node.beam_pid() is None:
                continue
            result = node._ctl(
                "list_queues",
                "-p",
                vhost,
                "name",
                "leader",
                "--formatter",
                "json",
                check=False,
                timeout=30,
            )
            if result.returncode != 0:
                continue
            found = {
                str(row["name"]): self.index_of(str(row["leader"]))
                for row in json.loads(result.stdout)
                if row.get("name") in queues and row.get("leader")
            }
            if set(found) == set(queues):
                return found
        raise RuntimeError(f"no live node knows the leader of each of {', '.join(queues)}")

    def destroy(self) -> None:
        """SIGKILL every node (nothing of it is kept) and remove their folders."""
        for node in self.nodes:
            if node.beam_pid() is not None:
                node.signal(signal.SIGKILL)
            shutil.rmtree(node.base, ignore_errors=True)


class PostgresServer(Protocol):
    """What a test needs of a PostgreSQL it runs: one server (:class:`ThrowawayPostgres`) or a
    primary with a standby (:class:`ThrowawayPostgresPair`)."""

    @property
    def admin_dsn(self) -> str: ...

    def dsn(self, database: str) -> str: ...

    def signal_all(self, sig: signal.Signals) -> None: ...


class ThrowawayPostgres:
    """A PostgreSQL cluster made with ``initdb`` in a folder of its own, on its own port.

    ``options`` are extra ``postgres -c name=value`` settings; ``hba``, when given, replaces
    ``pg_hba.conf`` (initdb's is trust for everything). :meth:`add_file` puts a file such as a
    TLS key in the cluster's folder, owned by postgres, before :meth:`start`.
    """

    def __init__(
        self,
        version_bin: Path | None = None,
        *,
        options: Mapping[str, str] | None = None,
        hba: str | None = None,
        netns: str | None = None,
        address: str = "127.0.0.1",
    ) -> None:
        """Nothing runs yet: :meth:`init` (or a base backup, see :class:`ThrowawayPostgresPair`)
        makes the data folder, :meth:`start` starts it. ``netns``: run in that network namespace,
        listening on ``address`` there."""
        self.bin = version_bin or _postgres_bin()
        self.port = free_port()
        self.base = Path(f"/tmp/throwaway-pg-{uuid.uuid4().hex[:8]}")
        self.data = self.base / "data"
        self.netns = netns
        self.address = address
        self.admin_dsn = f"postgresql://postgres@{address}:{self.port}/postgres"
        self.options = dict(options or {})
        self.hba = hba

    def dsn(self, database: str) -> str:
        return f"postgresql://postgres@{self.address}:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = 120) -> None:
        subprocess.run(
            _as_user("postgres", list(argv), netns=self.netns),
            check=True,
            timeout=timeout,
            cwd="/",
            capture_output=True,
        )

    def _make_base(self) -> None:
        self.base.mkdir(parents=True)
        shutil.chown(self.base, "postgres", "postgres")

    def init(self) -> None:
        self._make_base()
        self._run(
            str(self.bin / "initdb"),
            "-D",
            str(self.data),
            "-U",
            "postgres",
            "-A",
            "trust",
            "--no-sync",
            "-E",
            "UTF8",
        )
        if self.hba is not None:
            hba = self.data / "pg_hba.conf"
            hba.write_text(self.hba)
            shutil.chown(hba, "postgres", "postgres")

    def init_standby_of(self, primary: ThrowawayPostgres, name: str) -> None:
        """Instead of :meth:`init`: a base backup of ``primary`` that, started, streams from it
        as ``name`` (``pg_basebackup -R`` writes the connection and ``standby.signal``)."""
        self._make_base()
        self._run(
            str(self.bin / "pg_basebackup"),
            *("-D", str(self.data), "-X", "stream", "-R", "--no-sync"),
            *("-d", f"host=127.0.0.1 port={primary.port} user=postgres application_name={name}"),
        )

    def add_file(self, name: str, source: Path, mode: int = 0o600) -> Path:
        """Copy ``source`` into the cluster's folder, owned by postgres; its path for options."""
        target = self.base / name
        shutil.copyfile(source, target)
        shutil.chown(target, "postgres", "postgres")
        target.chmod(mode)
        return target

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses={self.address} -c fsync=off "
            "-c synchronous_commit=off -c full_page_writes=off"
        )
        for name, value in self.options.items():
            options += f" -c {name}={value}"
        self._run(
            str(self.bin / "pg_ctl"),
            "-D",
            str(self.data),
            "-o",
            options,
            "-l",
            str(self.base / "log"),
            "-w",
            "-t",
            "60",
            "start",
        )

    def stop(self) -> None:
        with contextlib.suppress(subprocess.CalledProcessError):
            self._run(str(self.bin / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop")

    def _pids(self) -> list[int]:
        pid_file = self.data / "postmaster.pid"
        if not pid_file.exists():
            return []
        postmaster = int(pid_file.read_text().splitlines()[0])
        children = subprocess.run(
            ["pgrep", "-P", str(postmaster)], capture_output=True, text=True, check=False
        ).stdout.split()
        return [postmaster, *(int(pid) for pid in children)]

    def freeze(self) -> None:
        """SIGSTOP the postmaster and every backend: connections hang instead of failing."""
        self.signal_all(signal.SIGSTOP)

    def thaw(self) -> None:
        self.signal_all(signal.SIGCONT)

    def signal_all(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the postmaster and every backend, skipping any that exit meanwhile
        (a backend ends whenever its client disconnects, so :meth:`freeze` and :meth:`thaw` can
        race with one while clients come and go)."""
        for pid in self._pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def destroy(self) -> None:
        self.thaw()
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


def _running(pid: int) -> bool:
    """Whether ``pid`` is a live process (a zombie is not: a detached node's parent may never
    reap it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def _wait_gone(pid: int, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _running(pid):
            return
        time.sleep(0.05)
    raise RuntimeError(f"process {pid} still there {timeout:g}s after SIGKILL")


def _postgres_bin() -> Path:
    versions = sorted(Path("/usr/lib/postgresql").iterdir(), key=lambda p: int(p.name))
    return versions[-1] / "bin"


STANDBY_NAME = "standby"
"""The standby's ``application_name`` on the primary, as ``synchronous_standby_names`` lists it."""


class ThrowawayPostgresPair:
    """A :class:`ThrowawayPostgres` primary and a streaming standby of it (``pg_basebackup -R``).

    ``synchronous``: the primary's commits wait until the standby has flushed them
    (``synchronous_standby_names`` names it, ``synchronous_commit=on``); otherwise a commit
    returns once local, and the standby follows when it can. :meth:`kill_primary` then
    :meth:`promote_standby` is a failover: :meth:`dsn` names both hosts with
    ``target_session_attrs=read-write``, so a client finds whichever is the primary.
    """

    def __init__(self, *, synchronous: bool) -> None:
        self.synchronous = synchronous
        replication = {"wal_level": "replica", "max_wal_senders": "4", "synchronous_commit": "on"}
        if synchronous:
            replication["synchronous_standby_names"] = STANDBY_NAME
        self.primary = ThrowawayPostgres(options=replication)
        # The standby's own settings: after promotion it is a primary with no standby, so it
        # must not wait for one.
        self.standby = ThrowawayPostgres(options={"synchronous_commit": "on", "hot_standby": "on"})

    @property
    def admin_dsn(self) -> str:
        return self.dsn("postgres")

    def dsn(self, database: str) -> str:
        """Both hosts, the primary wanted: whichever is the primary now (after a failover, the
        promoted standby)."""
        hosts = f"127.0.0.1:{self.primary.port},127.0.0.1:{self.standby.port}"
        return f"postgresql://postgres@{hosts}/{database}?target_session_attrs=read-write"

    def signal_all(self, sig: signal.Signals) -> None:
        self.primary.signal_all(sig)
        self.standby.signal_all(sig)

    def start(self) -> None:
        self.primary.init()
        self.primary.start()
        self.standby.init_standby_of(self.primary, STANDBY_NAME)
        self.standby.start()
        self.await_streaming()

    def _on_primary(self, query: str) -> str:
        """``query``'s answer on the primary, as ``psql`` prints it unaligned (empty on error)."""
        argv = [str(self.primary.bin / "psql"), "-XAtq", "-d", self.primary.admin_dsn, "-c", query]
        return subprocess.run(
            _as_user("postgres", argv), capture_output=True, text=True, check=False, cwd="/"
        ).stdout.strip()

    def await_streaming(self, timeout: float = 60) -> None:
        """Wait until the primary sees the standby streaming (for a synchronous pair: as its
        synchronous standby), so that commits are replicated from now on."""
        wanted = "sync" if self.synchronous else "async"
        query = (
            "SELECT sync_state FROM pg_stat_replication "
            f"WHERE application_name = '{STANDBY_NAME}' AND state = 'streaming'"
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._on_primary(query) == wanted:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the standby is not streaming ({wanted}) after {timeout:g}s")

    def hold_replication(self, sig: signal.Signals = signal.SIGSTOP) -> None:
        """SIGSTOP (or with SIGCONT, resume) the primary's WAL sender: the standby falls behind
        as over a slow link. (Stopping the standby would not do: WAL already sent waits in its
        socket buffer and still arrives after the primary dies.)"""
        for pid in self._on_primary("SELECT pid FROM pg_stat_replication").split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), sig)

    def kill_primary(self) -> None:
        """SIGKILL the primary's postmaster and every backend: commits in flight go with it."""
        self.primary.signal_all(signal.SIGKILL)

    def promote_standby(self) -> None:
        """``pg_ctl promote``: the standby ends recovery and takes writes (waits until it does)."""
        self.standby._run(
            str(self.standby.bin / "pg_ctl"), "-D", str(self.standby.data), "-w", "promote"
        )

    def destroy(self) -> None:
        self.standby.destroy()
        self.primary.destroy()
