"""What only RabbitMQ's management HTTP API can tell: the bindings, an exchange's arguments, and
where a queue's leader is.

AMQP can declare a binding but never list one, says nothing of the node a quorum queue's leader
runs on, and RabbitMQ accepts an exchange declared again with other arguments than it has (it
compares only ``alternate-exchange``); ``consumer topology check`` asks the management API for
all three when ``CONSUMER_MANAGEMENT_URL`` is set (``http://user:password@host:15672``; the
credentials go as basic auth, and never into a message).
"""

from __future__ import annotations

import base64
from collections.abc import Iterable
from typing import Any
from urllib.parse import quote, unquote, urlsplit, urlunsplit

import aiohttp

from topology.model import Exchange

__all__ = ["ManagementError", "exchange_differences", "get_json", "read_leaders"]

_TIMEOUT = aiohttp.ClientTimeout(total=10)


class ManagementError(Exception):
    """The management API could not be asked, or refused; the message says why in one line."""


def _basic_auth(user: str, password: str) -> str:
    # By hand: aiohttp deprecates BasicAuth, and its replacement is newer than our floor.
    return "Basic " + base64.b64encode(f"{user}:{password}".encode()).decode("ascii")


async def get_json(management_url: str, path: str) -> Any:
    """``GET <management_url>/api/<path>``, its JSON; anything but a 200 a
    :class:`ManagementError` that names the API without its credentials."""
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
    try:
        async with (
            aiohttp.ClientSession(timeout=_TIMEOUT) as session,
            session.get(f"{base}/api/{path}", headers=headers) as response,
        ):
            if response.status != 200:
                shown = path.split("/", 1)[0]
                raise ManagementError(
                    f"the management API answered {response.status} {response.reason} for "
                    f"{base}/api/{shown}"
                )
            return await response.json()
    except (aiohttp.ClientError, TimeoutError) as error:
        raise ManagementError(
            f"cannot reach the management API at {base}: {error or type(error).__name__}"
        ) from None


async def read_leaders(management_url: str, vhost: str, queues: Iterable[str]) -> dict[str, str]:
    """The node each of ``queues`` has its leader on (a quorum queue's ``leader``; a classic
    queue's ``node``), ``?`` where the broker does not say."""
    leaders: dict[str, str] = {}
    for queue in queues:
        row = await get_json(
            management_url, f"queues/{quote(vhost, safe='')}/{quote(queue, safe='')}"
        )
        leaders[queue] = str(row.get("leader") or row.get("node") or "?")
    return leaders


async def exchange_differences(
    management_url: str, vhost: str, exchanges: Iterable[Exchange]
) -> list[str]:
    """Each argument of the plan's ``exchanges`` (those that have any) that the broker's exchange
    of that name has otherwise, one line each."""
    lines: list[str] = []
    for exchange in exchanges:
        if not exchange.arguments:
            continue
        path = f"exchanges/{quote(vhost, safe='')}/{quote(exchange.name, safe='')}"
        present = (await get_json(management_url, path)).get("arguments") or {}
        for key, wanted in sorted(exchange.arguments.items()):
            current = present.get(key)
            if current != wanted:
                shown = "none" if current is None else current
                lines.append(
                    f"exchange {exchange.name}: {key} is {shown}, the plan wants {wanted} "
                    "(an exchange keeps the arguments it was made with: delete it, then apply)"
                )
    return lines
