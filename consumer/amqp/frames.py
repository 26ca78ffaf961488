"""AMQP frames read off the socket in bulk and decoded without pamqp's generic machinery.

aiormq reads every frame with three ``readexactly`` calls under a lock into a ``BytesIO``, and
pamqp decodes it by walking the spec's attribute list, slicing the rest of the frame after every
field. A delivery is three frames (method, content header, body): on the service's two cores that
came to about 50 µs of pamqp alone per message, a sixth of the service's CPU at full rate.
:class:`BulkFrameReceiver` takes what the socket holds at once and cuts the frames out of it;
:func:`decode_frame` builds the three frames of a delivery directly and hands every other frame
(and any frame the fast path cannot read) to pamqp, so what comes out is what pamqp would have
built, errors included. The property decoders are the ones :func:`consumer.amqp.wire.install` put
in pamqp's tables (the headers table's is the service's own, read by offset within its limits),
given a view of the rest of the frame, never a copy: a hostile header costs only its message, and
no more than its bytes, here too.

:func:`install` puts the receiver in aiormq's place (:mod:`consumer.amqp.fast_paths`).
"""

from __future__ import annotations

import asyncio
import struct
from typing import Any, cast

import aiormq.connection
import pamqp.frame
from aiormq.exceptions import AMQPConnectionError, InvalidFrameError, ProtocolSyntaxError
from pamqp import body, commands, constants, decode, header
from pamqp.exceptions import PAMQPException

__all__ = ["PROPERTY_NAMES", "BulkFrameReceiver", "decode_frame", "install", "uninstall"]

ReceivedFrame = tuple[int, int, Any]
"""What aiormq's frame receiver yields: the bytes the frame took, its channel, the frame."""

_READ_SIZE = 256 * 1024
_FRAME_HEADER = struct.Struct(">BHI")
_METHOD_INDEX = struct.Struct(">I")
_LONG_LONG = struct.Struct(">q")
_CONTENT_HEADER = struct.Struct(">HHQ")
_SHORT = struct.Struct(">H")
_OCTET = struct.Struct("B")
_FRAME_END = constants.FRAME_END
_LARGE_BODY_FRAME = 64 * 1024
"""A body frame this large, not yet whole in the buffer, has its rest read in one piece."""

_DELIVER = commands.Basic.Deliver
_PROPERTIES = commands.Basic.Properties
PROPERTY_NAMES = (
    "content_type",
    "content_encoding",
    "headers",
    "delivery_mode",
    "priority",
    "correlation_id",
    "reply_to",
    "expiration",
    "message_id",
    "timestamp",
    "message_type",
    "user_id",
    "app_id",
    "cluster_id",
)
"""Basic's properties in the order a content header lists them (AMQP 0-9-1), which is the
order of the assignment in :func:`_content_header`; a pamqp that differed is refused by
:func:`consumer.amqp.fast_paths.problems`, and this receiver is then not installed."""
try:
    _DEFAULTS = tuple(getattr(_PROPERTIES(), name) for name in PROPERTY_NAMES)
    # Each property's place, flag bit and AMQP type.
    _PROPERTY_TYPES = tuple(
        (index, _PROPERTIES.flags[name], getattr(_PROPERTIES, "_" + name))
        for index, name in enumerate(PROPERTY_NAMES)
    )
except (AttributeError, KeyError, TypeError):  # pragma: no cover - refused at install
    _DEFAULTS, _PROPERTY_TYPES = (), ()


class _Unreadable(Exception):
    """The fast path cannot read this frame: pamqp decides what it is."""


def decode_frame(frame: bytes) -> Any:
    """The frame in ``frame`` (one whole frame: header, payload, frame end), as pamqp builds it.
    Raises :class:`InvalidFrameError` as aiormq does."""
    # Only a frame with a payload and its frame end in place takes the fast path; pamqp reads
    # every other (a heartbeat), or says why it cannot (an empty body frame, a lost frame end).
    if len(frame) > 8 and frame[-1] == constants.FRAME_END:
        frame_type = frame[0]
        payload = frame[7:-1]
        try:
            if frame_type == constants.FRAME_BODY:
                return body.ContentBody(payload)
            if frame_type == constants.FRAME_HEADER:
                return _content_header(payload)
            if (
                frame_type == constants.FRAME_METHOD
                and len(payload) >= 4
                and _METHOD_INDEX.unpack_from(payload)[0] == _DELIVER.index
            ):
                return _deliver(payload)
        except (_Unreadable, struct.error, ValueError, IndexError, TypeError):
            pass  # pamqp reads it, or says why it cannot
    try:
        return pamqp.frame.unmarshal(frame)[2]
    except PAMQPException as error:
        raise InvalidFrameError(str(error)) from error


def _short_str(payload: bytes, offset: int) -> tuple[int, str]:
    # The decoder as consumer.amqp.wire made it (replacement characters, never an error).
    consumed, value = decode.METHODS["shortstr"](payload[offset : offset + 256])
    return offset + consumed, cast(str, value)


def _deliver(payload: bytes) -> commands.Basic.Deliver:
    offset, consumer_tag = _short_str(payload, 4)
    (delivery_tag,) = _LONG_LONG.unpack_from(payload, offset)
    (bits,) = _OCTET.unpack_from(payload, offset + 8)
    offset, exchange = _short_str(payload, offset + 9)
    offset, routing_key = _short_str(payload, offset)
    if offset > len(payload):
        raise _Unreadable("a truncated Basic.Deliver")
    frame: commands.Basic.Deliver = _DELIVER.__new__(_DELIVER)
    frame.consumer_tag = consumer_tag
    frame.delivery_tag = delivery_tag
    frame.redelivered = bool(bits & 1)
    frame.exchange = exchange
    frame.routing_key = routing_key
    return frame


def _content_header(payload: bytes) -> header.ContentHeader:
    class_id, weight, body_size = _CONTENT_HEADER.unpack_from(payload)
    offset, flags, word = 12, 0, 0
    while True:
        (partial,) = _SHORT.unpack_from(payload, offset)
        offset += 2
        flags |= partial << (word * 16)
        if not partial & 1:
            break
        word += 1
    values = list(_DEFAULTS)
    methods = decode.METHODS
    view = memoryview(payload)
    for index, flag, amqp_type in _PROPERTY_TYPES:
        if flags & flag:
            if amqp_type == "shortstr":
                offset, values[index] = _short_str(payload, offset)
            else:
                consumed, values[index] = methods[amqp_type](view[offset:])
                offset += consumed
    properties: commands.Basic.Properties = _PROPERTIES.__new__(_PROPERTIES)
    (
        properties.content_type,
        properties.content_encoding,
        properties.headers,
        properties.delivery_mode,
        properties.priority,
        properties.correlation_id,
        properties.reply_to,
        properties.expiration,
        properties.message_id,
        properties.timestamp,
        properties.message_type,
        properties.user_id,
        properties.app_id,
        properties.cluster_id,
    ) = values
    content_header = header.ContentHeader(weight, body_size, properties)
    content_header.class_id = class_id
    return content_header


class BulkFrameReceiver(aiormq.connection.FrameReceiver):
    """aiormq's frame receiver, reading what the socket holds at once and cutting the frames out
    of that buffer (see the module docstring). The same frames, the same errors."""

    def __init__(self, reader: asyncio.StreamReader) -> None:
        super().__init__(reader)
        self._buffer = bytearray()
        self._start = 0
        self._missing = 0
        """What the large body frame at the buffer's start still lacks (:meth:`_rest_of_body`)."""

    async def get_frame(self) -> ReceivedFrame:
        received = self._next()
        while received is None:
            if self._missing:
                received = await self._rest_of_body()
            else:
                await self._fill()
                received = self._next()
        return received

    def _next(self) -> ReceivedFrame | None:
        """The next whole frame in the buffer, or None until more has arrived."""
        buffer, start = self._buffer, self._start
        available = len(buffer) - start
        if available < 7:
            return None
        if not self.started:
            if buffer.startswith(b"AMQP", start):
                raise ProtocolSyntaxError("Unexpected AMQP protocol header")
            self.started = True
        frame_type, channel, size = _FRAME_HEADER.unpack_from(buffer, start)
        end = start + 8 + size
        if available < 8 + size:
            if frame_type == constants.FRAME_BODY and size >= _LARGE_BODY_FRAME:
                self._missing = 8 + size - available
            return None
        # One copy out of the buffer, through a view released before the buffer is resized: a
        # body frame's payload straight into its ContentBody (a body over the limit is 32 MiB and
        # more of these, read only to be dropped), any other frame whole for decode_frame.
        with memoryview(buffer) as view:
            if buffer[start] == constants.FRAME_BODY and size and buffer[end - 1] == _FRAME_END:
                received: Any = body.ContentBody(bytes(view[start + 7 : end - 1]))
            else:
                received = bytes(view[start:end])
        self._start = end
        if end == len(buffer):
            buffer.clear()
            self._start = 0
        elif end > _READ_SIZE:
            del buffer[:end]
            self._start = 0
        if isinstance(received, bytes):
            received = decode_frame(received)
        return 8 + size, channel, received

    async def _rest_of_body(self) -> ReceivedFrame:
        """The large body frame whose start the buffer holds, its rest read in one piece: the
        payload is then copied once, from the two parts, where the buffer would copy it twice
        more (appended, then cut out). A body over the limit is hundreds of these, read only to
        be dropped (issue 29)."""
        missing, self._missing = self._missing, 0
        rest = await self._read(missing, exactly=True)
        buffer, start = self._buffer, self._start
        if rest[-1] != _FRAME_END:
            # A lost frame end: the buffer's way, where pamqp says what is wrong.
            buffer += rest
            received = self._next()
            assert received is not None
            return received
        _, channel, size = _FRAME_HEADER.unpack_from(buffer, start)
        with memoryview(buffer) as head, memoryview(rest) as tail:
            payload = b"".join((head[start + 7 :], tail[:-1]))
        buffer.clear()
        self._start = 0
        return 8 + size, channel, body.ContentBody(payload)

    async def _fill(self) -> None:
        reader = self.reader
        if reader is None:
            raise AMQPConnectionError()
        if reader.at_eof() and self._start == len(self._buffer):
            raise StopAsyncIteration
        self._buffer += await self._read(_READ_SIZE, exactly=False)

    async def _read(self, size: int, *, exactly: bool) -> bytes:
        """Up to ``size`` bytes (``exactly`` that many) from the socket, its errors aiormq's."""
        reader = self.reader
        if reader is None:
            raise AMQPConnectionError()
        try:
            chunk = await (reader.readexactly(size) if exactly else reader.read(size))
        except asyncio.IncompleteReadError:
            chunk = b""
        except ConnectionRefusedError as error:
            raise AMQPConnectionError(f"Server connection refused: {error!r}") from error
        except ConnectionResetError as error:
            raise AMQPConnectionError(f"Server connection reset: {error!r}") from error
        except ConnectionError as error:
            raise AMQPConnectionError(f"Server connection error: {error!r}") from error
        except OSError as error:
            raise AMQPConnectionError(f"Server communication error: {error!r}") from error
        if not chunk:
            held = len(self._buffer) - self._start
            raise AMQPConnectionError(
                "Server connection unexpectedly closed. "
                f"Read {held} bytes of a frame but the connection ended"
            )
        return chunk


def install() -> None:
    """Read frames with :class:`BulkFrameReceiver` in every aiormq connection opened after this
    (aiormq builds its receiver by this module-level name when it connects). Through
    :func:`consumer.amqp.fast_paths.install`, which checks aiormq first."""
    aiormq.connection.FrameReceiver = BulkFrameReceiver  # type: ignore[misc]


def uninstall() -> None:
    """aiormq's own receiver again, for the connections opened after this."""
    aiormq.connection.FrameReceiver = BulkFrameReceiver.__mro__[1]  # type: ignore[misc,assignment]
