"""The HTTP endpoint listens only on CONSUMER_HTTP_HOST and serves three paths to GET, nothing else.

The service runs with its broker and database unreachable: the HTTP side needs neither.
"""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import socket
import subprocess
from pathlib import Path

import pytest

from consumer.observe.http import HEAD_TIMEOUT, MAX_CONNECTIONS, MAX_LIFETIME, MAX_PER_PEER
from tests.servers import free_port
from tests.support import ServiceProcess, TestEnv, wait_until

OTHER_LOOPBACK = "127.0.0.2"  # on Linux all of 127.0.0.0/8 is local


def non_loopback_addresses() -> list[str]:
    """This machine's own IPv4 addresses that are not loopback (none in a bare sandbox)."""
    ip = shutil.which("ip")
    if ip is None:
        return []
    listed = subprocess.run(
        [ip, "-4", "-o", "addr", "show", "scope", "global"],
        capture_output=True,
        text=True,
        check=False,
        timeout=10,
    ).stdout
    return [line.split()[3].split("/")[0] for line in listed.splitlines() if len(line.split()) > 3]


def status_of(host: str, port: int, request: bytes) -> int:
    """The status code the server answers a raw HTTP/1.1 request with."""
    with socket.create_connection((host, port), timeout=5) as connection:
        connection.sendall(request)
        head = b""
        while b"\r\n" not in head:
            chunk = connection.recv(4096)
            if not chunk:
                break
            head += chunk
    return int(head.split(b" ", 2)[1])


def request(method: str, path: str, body: bytes = b"") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: test\r\nConnection: close\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def reachable(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=2):
            return True
    except OSError:
        return False


def unreachable_env(tmp_path: Path) -> TestEnv:
    return TestEnv(
        name="httptest",
        database_url=f"postgresql://nobody@127.0.0.1:{free_port()}/nothing",
        amqp_url=f"amqp://nobody:nothing@127.0.0.1:{free_port()}/",
        http_port=free_port(),
        log_dir=tmp_path,
        overrides={"handlers": "consumer.handlers.inventory"},
    )


async def answering(service: ServiceProcess, host: str) -> None:
    async def up() -> bool:
        assert service.returncode is None, service.log_text()
        return await asyncio.to_thread(reachable, host, service.port)

    await wait_until(up, what=f"HTTP on {host}")


async def test_by_default_it_listens_on_loopback_only_and_serves_three_paths(
    tmp_path: Path,
) -> None:
    # Given the service with the default CONSUMER_HTTP_HOST
    env = unreachable_env(tmp_path)
    service = ServiceProcess(env).start()
    await answering(service, "127.0.0.1")
    port = service.port
    try:
        # Then no other local address reaches it, loopback or not
        for address in (OTHER_LOOPBACK, *non_loopback_addresses()):
            assert not reachable(address, port), f"HTTP answers on {address}"

        # And the three paths answer GET (HEAD too, as GET's header-only twin)
        assert status_of("127.0.0.1", port, request("GET", "/metrics")) == 200
        assert status_of("127.0.0.1", port, request("GET", "/healthz")) == 200
        assert status_of("127.0.0.1", port, request("GET", "/readyz")) == 503  # nothing reached
        assert status_of("127.0.0.1", port, request("HEAD", "/healthz")) == 200

        # And any other path is 404, whatever its spelling
        for path in (
            "/",
            "/metrics/",
            "/Metrics",
            "/metrics/extra",
            "/admin",
            "/debug/pprof",
            "/..%2f..%2fetc%2fpasswd",
            "/../etc/passwd",
            "//metrics",
            "/healthz%00",
        ):
            assert status_of("127.0.0.1", port, request("GET", path)) == 404, path

        # And any other method on the three paths is 405
        for method in ("POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE"):
            for path in ("/metrics", "/healthz", "/readyz"):
                status = status_of("127.0.0.1", port, request(method, path, b"{}"))
                assert status == 405, (method, path, status)
        # A body larger than the service would ever read is refused too
        assert status_of("127.0.0.1", port, request("POST", "/metrics", b"x" * 65536)) in (
            405,
            413,
        )
    finally:
        await service.stop()


@pytest.mark.parametrize("where", ["another loopback address", "a non-loopback address"])
async def test_it_listens_where_consumer_http_host_says(where: str, tmp_path: Path) -> None:
    if where == "another loopback address":
        host = OTHER_LOOPBACK
    else:
        addresses = non_loopback_addresses()
        if not addresses:
            pytest.skip("this machine has no non-loopback IPv4 address")
        host = addresses[0]

    # Given the service told to listen on that address
    service = ServiceProcess(unreachable_env(tmp_path), http_host=host).start()
    try:
        # Then it answers there, and not on 127.0.0.1
        await answering(service, host)
        assert status_of(host, service.port, request("GET", "/healthz")) == 200
        assert not reachable("127.0.0.1", service.port)
    finally:
        await service.stop()


async def test_clients_that_trickle_their_headers_cannot_starve_the_probes(
    tmp_path: Path,
) -> None:
    # Given the service, and 300 connections from another address (the attacker's) that send
    # their request's headers a byte now and then, never finishing (slowloris)
    service = ServiceProcess(unreachable_env(tmp_path)).start()
    await answering(service, "127.0.0.1")
    trickling: list[socket.socket] = []
    try:
        for _ in range(300):
            with contextlib.suppress(OSError):
                connection = socket.create_connection(
                    ("127.0.0.1", service.port), timeout=5, source_address=(OTHER_LOOPBACK, 0)
                )
                connection.sendall(b"GET /metrics HTTP/1.1\r\nHost: t\r\n")
                trickling.append(connection)

        # Then the probes, from their own address, are still answered meanwhile
        for _ in range(3):
            assert status_of("127.0.0.1", service.port, request("GET", "/healthz")) == 200
            for connection in trickling:
                with contextlib.suppress(OSError):
                    connection.sendall(b"X")
            await asyncio.sleep(1)

        # And the server closes every one of them: beyond the 16 one address may hold to make
        # room for the next, the rest when their request head is late
        def closed_by_server(connection: socket.socket) -> bool:
            connection.settimeout(MAX_LIFETIME + 10)
            try:
                return connection.recv(1) == b""
            except (ConnectionResetError, BrokenPipeError):
                return True

        assert all(
            await asyncio.gather(*(asyncio.to_thread(closed_by_server, c) for c in trickling[:20]))
        )
    finally:
        for connection in trickling:
            connection.close()
        await service.stop()


HALF_SENT = b"GET /healthz HTTP/1.1\r\nHost: t\r\n"  # no empty line: the head never ends


def half_sent(port: int, source: str = "127.0.0.1") -> socket.socket:
    """A connection that sent the start of a request head and nothing more."""
    connection = socket.create_connection(
        ("127.0.0.1", port), timeout=5, source_address=(source, 0)
    )
    connection.sendall(HALF_SENT)
    return connection


def probe(port: int) -> int | None:
    """``/healthz``'s status for a probe from 127.0.0.1 that waits at most a second; None if the
    connection was refused, closed or not answered."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as connection:
            connection.sendall(request("GET", "/healthz"))
            head = connection.recv(4096)
    except OSError:
        return None
    return int(head.split(b" ", 2)[1]) if head.startswith(b"HTTP/1.1 ") else None


def closed_by_server(connection: socket.socket, within: float) -> bool:
    connection.settimeout(within)
    try:
        return connection.recv(1) == b""
    except (ConnectionResetError, BrokenPipeError):
        return True
    except TimeoutError:
        return False


def closed_now(connection: socket.socket) -> bool:
    """Whether the server has closed ``connection`` by now (without waiting)."""
    connection.setblocking(False)
    try:
        return connection.recv(1, socket.MSG_PEEK) == b""
    except BlockingIOError:
        return False
    except (ConnectionResetError, BrokenPipeError):
        return True


async def test_idle_half_sent_requests_from_the_probes_own_address_cannot_lock_it_out(
    tmp_path: Path,
) -> None:
    # Given the service, and as many idle half-sent requests as one address may hold, from the
    # address the probes come from (a node's kubelet, a shared NAT), renewed as they are closed
    service = ServiceProcess(unreachable_env(tmp_path)).start()
    await answering(service, "127.0.0.1")
    held: list[socket.socket] = []
    try:
        for _ in range(3):
            held += [half_sent(service.port) for _ in range(MAX_PER_PEER)]

            # Then a probe from that address is answered at once, each time
            assert await asyncio.to_thread(probe, service.port) == 200

        # And each half-sent request is closed: the oldest to make room, the rest once their
        # request head is late, long before the connection's lifetime is over
        closed = await asyncio.gather(
            *(asyncio.to_thread(closed_by_server, c, HEAD_TIMEOUT + 2) for c in held)
        )
        assert all(closed)
    finally:
        for connection in held:
            connection.close()
        await service.stop()


async def test_the_global_bound_holds_and_a_probe_still_gets_in(tmp_path: Path) -> None:
    # Given the service, and more idle half-sent requests than it keeps open at once, from ten
    # addresses (each within the per-address bound)
    service = ServiceProcess(unreachable_env(tmp_path)).start()
    await answering(service, "127.0.0.1")
    sources = [f"127.0.0.{n}" for n in range(10, 20)]
    held = [half_sent(service.port, source) for source in sources for _ in range(MAX_PER_PEER)]
    try:
        # When a probe comes from an address of its own
        status = await asyncio.to_thread(probe, service.port)
        await asyncio.sleep(0.2)  # for the closes to arrive, well within the head time limit

        # Then it is answered, and no more than the global bound were open at once: the oldest
        # idle ones were closed to make room, the probe's place too
        assert status == 200
        closed = [closed_now(connection) for connection in held]
        surplus = len(held) - MAX_CONNECTIONS
        assert closed[: surplus + 1] == [True] * (surplus + 1)
        assert not any(closed[surplus + 1 :])
    finally:
        for connection in held:
            connection.close()
        await service.stop()


async def test_a_connection_serves_one_request_then_closes(tmp_path: Path) -> None:
    # Given the service, and a client that asks to keep its connection alive
    service = ServiceProcess(unreachable_env(tmp_path)).start()
    await answering(service, "127.0.0.1")
    try:
        with socket.create_connection(("127.0.0.1", service.port), timeout=5) as connection:
            connection.sendall(
                b"GET /healthz HTTP/1.1\r\nHost: t\r\nConnection: keep-alive\r\n\r\n"
            )
            answer = b""
            while chunk := connection.recv(4096):
                answer += chunk

        # Then it is answered, told the connection closes, and the server closed it (it never
        # idles between requests holding one of the address's places)
        assert answer.startswith(b"HTTP/1.1 200")
        assert b"Connection: close" in answer
    finally:
        await service.stop()
