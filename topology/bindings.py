"""The bindings on the broker compared with the plan's.

AMQP can declare a binding but never list one (nor can a probe tell one is there without routing
a message through it), so ``consumer topology check`` reads them from RabbitMQ's management HTTP
API (``GET /api/bindings/<vhost>``). The comparison is pure: :func:`compare_bindings`.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aiohttp

from topology.model import Binding, Topology

__all__ = ["BindingDifferences", "ManagementError", "compare_bindings", "read_bindings"]


_TIMEOUT = aiohttp.ClientTimeout(total=10)


class ManagementError(Exception):
    """The management API could not be asked, or refused; the message says why in one line."""


@dataclass(frozen=True, slots=True)
class BindingDifferences:
    """What the broker's bindings lack of the plan, and what it binds to the plan's queues that
    the plan does not (a type moved to another queue, still routed to the old one)."""

    missing: tuple[Binding, ...] = ()
    unplanned: tuple[Binding, ...] = ()

    def describe(self) -> list[str]:
        return [f"missing: {binding.describe()}" for binding in self.missing] + [
            f"not in the plan: {binding.describe()}" for binding in self.unplanned
        ]


def _key(binding: Binding) -> tuple[str, str, str, tuple[tuple[str, str], ...]]:
    arguments = tuple(sorted((str(k), str(v)) for k, v in binding.arguments.items()))
    return binding.exchange, binding.queue, binding.routing_key, arguments


def compare_bindings(plan: Topology, present: Iterable[Binding]) -> BindingDifferences:
    """The plan's bindings the broker lacks, and the broker's bindings from one of the plan's
    exchanges to one of its queues that the plan has not."""
    present = list(present)
    have = {_key(binding) for binding in present}
    wanted = {_key(binding) for binding in plan.bindings}
    exchanges = {exchange.name for exchange in plan.exchanges}
    queues = {queue.name for queue in plan.queues}
    missing = tuple(b for b in plan.bindings if _key(b) not in have)
    unplanned = tuple(
        b
        for b in present
        if b.exchange in exchanges and b.queue in queues and _key(b) not in wanted
    )
    return BindingDifferences(missing, unplanned)


def _basic_auth(user: str, password: str) -> str:
    # By hand: aiohttp deprecates BasicAuth, and its replacement is newer than our floor.
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


def _binding(row: Mapping[str, Any]) -> Binding | None:
    # The default exchange's implicit bindings ("") and exchange-to-exchange ones are not ours.
    if not row.get("source") or row.get("destination_type") != "queue":
        return None
    return Binding(
        str(row["source"]),
        str(row["destination"]),
        str(row.get("routing_key", "")),
        dict(row.get("arguments") or {}),
    )


async def read_bindings(management_url: str, vhost: str) -> list[Binding]:
    """Every queue binding of ``vhost``, from the management API at ``management_url``
    (``http://user:password@host:15672``; the credentials go as basic auth)."""
    parts = urlsplit(management_url)
    headers = {}
    if parts.username is not None:
        headers["Authorization"] = _basic_auth(
            unquote(parts.username), unquote(parts.password or "")
        )
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc = f"{netloc}:{parts.port}"
    base = urlunsplit((parts.scheme, netloc, parts.path.rstrip("/"), "", ""))
    url = f"{base}/api/bindings/{quote(vhost, safe='')}"
    try:
        async with (
            aiohttp.ClientSession(timeout=_TIMEOUT) as session,
            session.get(url, headers=headers) as response,
        ):
            if response.status != 200:
                raise ManagementError(
                    f"the management API answered {response.status} {response.reason} for "
                    f"{base}/api/bindings"
                )
            rows = await response.json()
    except (aiohttp.ClientError, TimeoutError) as error:
        raise ManagementError(
            f"cannot reach the management API at {base}: {error or type(error).__name__}"
        ) from None
    return [binding for row in rows if (binding := _binding(row)) is not None]
