"""The service's replacements of aiormq's and pamqp's private code, in one place: what each
replaces, what it holds aiormq and pamqp to, and which are installed.

==============================  ==========================================  =====================
hook                            replaces, process-wide                      for
==============================  ==========================================  =====================
:mod:`consumer.amqp.wire`       pamqp's decoders (``decode.METHODS``        safety: no message
                                entries), the tables' by the service's own  breaks its connection
:mod:`consumer.amqp.frames`     ``aiormq.connection.FrameReceiver``         speed
:mod:`consumer.amqp.direct_     ``aiormq.connection.Channel``               speed
consume`
==============================  ==========================================  =====================

``CONSUMER_AMQP_FAST_PATH=false`` leaves aiormq's own frame receiver and channel in place: slower,
otherwise the same. The total decoders stay installed either way: they are what keeps a hostile
header from closing the connection it came on (docs/operations/security.md), not a speed-up, and
the fast frame decoder reads properties through them too.

aiormq is pinned below 8, and a 7.x release may still rename what a hook relies on. Each hook's
:func:`problems` compare aiormq's and pamqp's private surface with what the hook replaces
(attribute names, method signatures, the module-level names patched). A fast path whose check
fails is not installed, that part runs on aiormq's own code, and start-up says so in one warning
line. The decoders are not a speed-up to do without: a pamqp they do not fit stops every command
that connects with one line (:class:`~consumer.errors.IncompatibleLibrary`), as
:func:`consumer.amqp.wire.self_test` does for one that decodes tables another way.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
import inspect
from collections.abc import Callable, Iterable
from types import ModuleType
from typing import Any

import aiormq.abc
import aiormq.channel
import aiormq.connection
from pamqp import body, commands, decode, header

from consumer.amqp import wire
from consumer.amqp.wire import TableLimits
from consumer.errors import IncompatibleLibrary

__all__ = ["HOOKS", "install", "problems", "refused"]

WIRE = "consumer.amqp.wire"
FRAMES = "consumer.amqp.frames"
DIRECT_CONSUME = "consumer.amqp.direct_consume"
HOOKS = (WIRE, FRAMES, DIRECT_CONSUME)
"""Every hook, by its module's name; the last two are the fast paths."""


def install(*, fast_path: bool, header_limits: TableLimits | None = None) -> None:
    """Put each hook in place, or aiormq's own code back: the total decoders always (within
    ``header_limits``), the fast paths when ``fast_path`` and their checks pass (:func:`refused`).
    For the connections and channels opened after this. Raises
    :class:`~consumer.errors.IncompatibleLibrary` if pamqp is not what the decoders replace."""
    found = problems()
    if WIRE in found:
        raise IncompatibleLibrary(
            f"pamqp's decoders are not what {WIRE} replaces: {'; '.join(found[WIRE])}; the "
            "service cannot hold its limits on hostile headers with it"
        )
    wire.install(header_limits)
    for name in (FRAMES, DIRECT_CONSUME):
        if name in found:
            continue  # never installed: aiormq's own code is in place
        module = importlib.import_module(name)
        if fast_path:
            module.install()
        else:
            module.uninstall()


def refused(*, fast_path: bool) -> dict[str, list[str]]:
    """The fast paths :func:`install` leaves out although they are wanted, each with what
    differs."""
    found = problems()
    return {name: found[name] for name in (FRAMES, DIRECT_CONSUME) if name in found and fast_path}


@functools.cache
def problems() -> dict[str, list[str]]:
    """What differs from what each hook replaces, by hook (none: every hook fits). Checked once:
    the libraries do not change under a running process."""
    checks: dict[str, Callable[[], list[str]]] = {
        WIRE: _wire_problems,
        FRAMES: _frames_problems,
        DIRECT_CONSUME: _direct_consume_problems,
    }
    found: dict[str, list[str]] = {}
    for name, check in checks.items():
        try:
            found_here = check()
        except Exception as error:  # a surface so different that looking at it fails
            found_here = [f"checking it failed: {type(error).__name__}: {error}"]
        if found_here:
            found[name] = found_here
    return found


def _importable(name: str) -> tuple[ModuleType | None, list[str]]:
    try:
        return importlib.import_module(name), []
    except Exception as error:  # it subclasses aiormq's classes at import
        return None, [f"{name} cannot be imported: {type(error).__name__}: {error}"]


def _wire_problems() -> list[str]:
    found = _keys("pamqp.decode.METHODS", decode, "METHODS", WIRE_METHODS)
    if found:
        return found
    for key in WIRE_METHODS:
        found += _parameters(f"pamqp.decode.METHODS[{key!r}]", decode.METHODS[key], ("value",))
    # pamqp decodes every property and argument through that table, by its module-level name:
    # replacing an entry reaches every decode (what the entries then refuse, wire.self_test checks).
    found += _refers("pamqp.decode.by_type", decode, "by_type", ("METHODS",))
    return found


WIRE_METHODS = ("table", "array", "shortstr", "longstr", "timestamp")


def _frames_problems() -> list[str]:
    module, found = _importable(FRAMES)
    if module is None:
        return found
    receiver = module.BulkFrameReceiver.__mro__[1]  # aiormq's, whatever is installed now
    found += _parameters(
        "aiormq.connection.FrameReceiver.__init__", receiver.__init__, ("self", "reader")
    )
    found += _coroutine(
        "aiormq.connection.FrameReceiver.get_frame", receiver, "get_frame", ("self",)
    )
    found += _assigns(
        "aiormq.connection.FrameReceiver.__init__", receiver.__init__, ("reader", "started")
    )
    found += _refers(
        "aiormq.connection.FrameReceiver.__anext__", receiver, "__anext__", ("get_frame",)
    )
    # The module-level name patched: aiormq builds each connection's receiver by it.
    found += _refers(
        "aiormq.connection.Connection.connect",
        aiormq.connection.Connection,
        "connect",
        ("FrameReceiver",),
    )
    properties = commands.Basic.Properties
    if tuple(getattr(properties, "__slots__", ())) != module.PROPERTY_NAMES:
        found.append("pamqp's Basic.Properties are not AMQP 0-9-1's, in its order")
    else:
        for name in module.PROPERTY_NAMES:
            if name not in getattr(properties, "flags", {}) or not hasattr(properties, "_" + name):
                found.append(f"pamqp's Basic.Properties has no flag or type for {name!r}")
    if not isinstance(getattr(commands.Basic.Deliver, "index", None), int):
        found.append("pamqp's Basic.Deliver has no method index")
    found += _parameters(
        "pamqp.commands.Basic.Deliver.__init__",
        commands.Basic.Deliver.__init__,
        ("self", "consumer_tag", "delivery_tag", "redelivered", "exchange", "routing_key"),
    )
    found += _parameters(
        "pamqp.header.ContentHeader.__init__",
        header.ContentHeader.__init__,
        ("self", "weight", "body_size", "properties"),
    )
    found += _parameters(
        "pamqp.body.ContentBody.__init__", body.ContentBody.__init__, ("self", "value")
    )
    return found


def _direct_consume_problems() -> list[str]:
    module, found = _importable(DIRECT_CONSUME)
    if module is None:
        return found
    channel = aiormq.channel.Channel
    # The module-level name patched: aiormq builds each channel by it.
    if not hasattr(aiormq.connection, "Channel"):
        found.append("aiormq.connection has no module-level Channel")
    found += _refers(
        "aiormq.connection.Connection.channel",
        aiormq.connection.Connection,
        "channel",
        ("Channel",),
    )
    found += _coroutine(
        "aiormq.Channel._on_deliver_frame", channel, "_on_deliver_frame", ("self", "frame")
    )
    found += _refers("aiormq.Channel._reader", channel, "_reader", ("_on_deliver_frame",))
    found += _coroutine("aiormq.Channel._get_frame", channel, "_get_frame", ("self",))
    found += _assigns("aiormq.Channel.__init__", channel.__init__, ("consumers",))
    found += _has_parameters(
        "aiormq.Channel.basic_consume",
        channel,
        "basic_consume",
        ("queue", "consumer_callback", "no_ack", "consumer_tag"),
    )
    found += _has_parameters("aiormq.Channel.close", channel, "close", ("exc",))
    delivered = aiormq.abc.DeliveredMessage
    fields = (
        {field.name for field in dataclasses.fields(delivered)}
        if dataclasses.is_dataclass(delivered)
        else set()
    )
    missing = {"delivery", "header", "body", "channel"} - fields
    if missing:
        found.append(f"aiormq.abc.DeliveredMessage has no field {', '.join(sorted(missing))}")
    return found


# -- what a check looks at ----------------------------------------------------------------------


def _keys(where: str, module: ModuleType, name: str, keys: Iterable[Any]) -> list[str]:
    table = getattr(module, name, None)
    if not isinstance(table, dict):
        return [f"{where} is not there"]
    return [f"{where} has no {key!r}" for key in keys if key not in table]


def _parameters(where: str, function: Any, expected: tuple[str, ...]) -> list[str]:
    """``function``'s parameters begin with ``expected``, in that order."""
    try:
        names = tuple(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return [f"{where} has no signature to read"]
    if names[: len(expected)] != expected:
        return [f"{where} takes ({', '.join(names)}), not ({', '.join(expected)})"]
    return []


def _has_parameters(where: str, owner: Any, name: str, expected: tuple[str, ...]) -> list[str]:
    function = getattr(owner, name, None)
    if function is None:
        return [f"{where} is not there"]
    try:
        names = set(inspect.signature(function).parameters)
    except (TypeError, ValueError):
        return [f"{where} has no signature to read"]
    missing = [parameter for parameter in expected if parameter not in names]
    return [f"{where} takes no {', '.join(missing)}"] if missing else []


def _coroutine(where: str, owner: Any, name: str, expected: tuple[str, ...]) -> list[str]:
    function = getattr(owner, name, None)
    if function is None:
        return [f"{where} is not there"]
    if not inspect.iscoroutinefunction(inspect.unwrap(function)):
        return [f"{where} is not a coroutine function"]
    return _parameters(where, function, expected)


def _names(function: Any) -> set[str]:
    """Every global and attribute name ``function``'s code (and the code nested in it) uses."""
    code = getattr(inspect.unwrap(function), "__code__", None)
    names: set[str] = set()
    stack = [code] if code is not None else []
    while stack:
        current = stack.pop()
        names.update(current.co_names)
        stack.extend(const for const in current.co_consts if inspect.iscode(const))
    return names


def _refers(where: str, owner: Any, name: str, expected: tuple[str, ...]) -> list[str]:
    """``owner.name``'s code uses each of ``expected`` (a global, or an attribute it reads)."""
    function = getattr(owner, name, None)
    if function is None:
        return [f"{where} is not there"]
    missing = [used for used in expected if used not in _names(function)]
    return [f"{where} no longer uses {', '.join(missing)}"] if missing else []


def _assigns(where: str, function: Any, attributes: tuple[str, ...]) -> list[str]:
    missing = [attribute for attribute in attributes if attribute not in _names(function)]
    return [f"{where} no longer sets {', '.join(missing)}"] if missing else []
