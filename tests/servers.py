"""Throwaway RabbitMQ nodes and PostgreSQL clusters for tests that stop, restart or freeze a server.

Each runs on its own ports and data folders, as the user its package runs as, so a test can kill it
without touching the shared services other tests use.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Mapping, Sequence
from pathlib import Path

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


def _as_user(user: str, argv: list[str], env: dict[str, str] | None = None) -> list[str]:
    prefix = ["runuser", "-u", user, "--"] if os.geteuid() == 0 else []
    assignments = [f"{key}={value}" for key, value in (env or {}).items()]
    return [*prefix, "env", *assignments, *argv]


class ThrowawayRabbit:
    """A RabbitMQ node of its own (``RABBITMQ_NODENAME``, ports and data folders).

    ``config`` lines (the attribute, read at each :meth:`start`) go into its ``rabbitmq.conf``;
    files they name (certificates, keys) can be put in the node's folder, readable by the
    rabbitmq user, with :meth:`add_file`.
    """

    def __init__(self, config: Sequence[str] = ()) -> None:
        self.node = f"t{uuid.uuid4().hex[:8]}@localhost"
        self.port = free_port()
        self.dist_port = free_port()
        # Under the rabbitmq user's home: Mnesia refuses some temporary file systems.
        self.base = RABBITMQ_HOME / f"throwaway-{self.node.split('@')[0]}"
        self.url = f"amqp://guest:guest@127.0.0.1:{self.port}/"
        self.config = list(config)

    @property
    def _env(self) -> dict[str, str]:
        base = self.base
        return {
            "HOME": str(RABBITMQ_HOME),
            "RABBITMQ_NODENAME": self.node,
            "RABBITMQ_NODE_IP_ADDRESS": "127.0.0.1",
            "RABBITMQ_NODE_PORT": str(self.port),
            "RABBITMQ_DIST_PORT": str(self.dist_port),
            "RABBITMQ_MNESIA_BASE": str(base / "mnesia"),
            "RABBITMQ_LOG_BASE": str(base / "log"),
            "RABBITMQ_CONFIG_FILE": str(base / "rabbitmq.conf"),
            "RABBITMQ_ENABLED_PLUGINS_FILE": str(base / "enabled_plugins"),
            "RABBITMQ_CONF_ENV_FILE": str(base / "rabbitmq-env.conf"),
            "RABBITMQ_PID_FILE": str(base / "pid"),
            "ERL_EPMD_ADDRESS": "127.0.0.1",
        }

    def _ctl(
        self, *args: str, check: bool = True, timeout: float = 60, input_text: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            _as_user(
                "rabbitmq", [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node, *args], self._env
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
        return _as_user("rabbitmq", [str(RABBITMQ_BIN / "rabbitmqctl"), "-n", self.node], self._env)

    def _prepare(self) -> None:
        if self.base.exists():
            return
        for sub in ("mnesia", "log"):
            (self.base / sub).mkdir(parents=True)
        for name in ("rabbitmq.conf", "enabled_plugins", "rabbitmq-env.conf"):
            (self.base / name).write_text("")
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

    def start(self, timeout: float = 90) -> None:
        self._prepare()
        if self.config:
            (self.base / "rabbitmq.conf").write_text("".join(f"{line}\n" for line in self.config))
        subprocess.run(
            _as_user("rabbitmq", [str(RABBITMQ_BIN / "rabbitmq-server"), "-detached"], self._env),
            check=True,
            timeout=30,
            cwd="/",
        )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self._ctl("await_startup", check=False, timeout=30).returncode == 0 and port_open(
                self.port
            ):
                return
            time.sleep(0.5)
        raise RuntimeError(f"RabbitMQ node {self.node} did not start; see {self.base / 'log'}")

    def stop(self) -> None:
        """Stop the node and wait until its process has exited (so its ports are free)."""
        self._ctl("stop", str(self.base / "pid"), check=False, timeout=120)

    def restart(self) -> None:
        self.stop()
        self.start()

    def close_all_connections(self) -> None:
        self._ctl("close_all_connections", "closed by a test")

    def destroy(self) -> None:
        self.stop()
        shutil.rmtree(self.base, ignore_errors=True)


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
    ) -> None:
        self.bin = version_bin or _postgres_bin()
        self.port = free_port()
        self.base = Path(f"/tmp/throwaway-pg-{uuid.uuid4().hex[:8]}")
        self.data = self.base / "data"
        self.admin_dsn = f"postgresql://postgres@127.0.0.1:{self.port}/postgres"
        self.options = dict(options or {})
        self.hba = hba

    def dsn(self, database: str) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/{database}"

    def _run(self, *argv: str, timeout: float = 120) -> None:
        subprocess.run(
            _as_user("postgres", list(argv)),
            check=True,
            timeout=timeout,
            cwd="/",
            capture_output=True,
        )

    def init(self) -> None:
        self.base.mkdir(parents=True)
        shutil.chown(self.base, "postgres", "postgres")
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

    def add_file(self, name: str, source: Path, mode: int = 0o600) -> Path:
        """Copy ``source`` into the cluster's folder, owned by postgres; its path for options."""
        target = self.base / name
        shutil.copyfile(source, target)
        shutil.chown(target, "postgres", "postgres")
        target.chmod(mode)
        return target

    def start(self) -> None:
        options = (
            f"-p {self.port} -k {self.base} -c listen_addresses=127.0.0.1 -c fsync=off "
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


def _postgres_bin() -> Path:
    versions = sorted(Path("/usr/lib/postgresql").iterdir(), key=lambda p: int(p.name))
    return versions[-1] / "bin"
