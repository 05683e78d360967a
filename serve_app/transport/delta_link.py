"""Delta links: a delta channel's batches on a TCP connection from the engine replica to the
ingress replica, instead of one Ray message per engine step.

Taking a streaming generator's item costs the receiver's process about ten times the CPU of
reading a frame off a socket (reports/notebook.md, session 51), and the ingress takes one per
engine step per engine replica. The channel's subscription (serve_app.transport.delta_channel)
stays a Ray call: it starts and ends the engine replica's draining of the outbox, its failure
is the replica's, and Serve routes it; only the batches move to the link.

The ingress replica connects to the port the engine replica listens on (its node's address,
in each request's ChannelledFirst), says which channel it reads, and gets an empty frame back
once the replica has it; each frame after that is one `packed` batch, 4 bytes of length
first. A link that breaks, or whose peer stops answering (keepalive probes, and unacknowledged
data, time out after LINK_DEAD_AFTER_S), ends the open requests of its channel at both ends:
the engine replica aborts them (their blocks come back) and the ingress resumes them from the
tokens their clients have, as when a replica dies. An ingress that cannot connect reads the
batches from the subscription as before. Engine calls go on the same link too, both ways
(serve_app.transport.link_call).
"""

from __future__ import annotations

import asyncio
import logging
import pickle
import socket
from collections.abc import Callable
from typing import Any

from serve_app.transport import link_call
from serve_app.transport.link_call import LinkCall

logger = logging.getLogger(__name__)

# A link whose peer has not acknowledged data, or answered keepalive probes, this long is
# broken (a partition, a node gone), not slow.
LINK_DEAD_AFTER_S = 5
# How long an ingress waits for an engine replica to accept its link before reading the
# channel through Ray instead.
CONNECT_TIMEOUT_S = 2.0
_HEADER = 4  # bytes of a frame's length
# Said after the channel's id (a tab between) by an ingress that sends engine calls on the
# link (serve_app.transport.link_call), and answered in the replica's first frame where it
# takes them: each later frame from the replica then starts with a byte that says what it
# holds. (Peers of an older version say and answer nothing: batches only, untagged.)
CALLS = "calls"
_BATCH, _ITEM = b"B", b"I"


class DeltaLinkLost(ConnectionError):
    """The link carrying a request's deltas broke: the request resumes elsewhere."""


def frame(data: bytes) -> bytes:
    return len(data).to_bytes(_HEADER, "big") + data


def tune(sock: socket.socket | None) -> None:
    """No Nagle delay; a dead peer noticed within LINK_DEAD_AFTER_S, idle or not."""
    if sock is None:
        return
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)
    for option, value in (
        ("TCP_KEEPIDLE", 1),
        ("TCP_KEEPINTVL", 1),
        ("TCP_KEEPCNT", LINK_DEAD_AFTER_S - 1),
        ("TCP_USER_TIMEOUT", LINK_DEAD_AFTER_S * 1000),
    ):
        if hasattr(socket, option):  # Linux's; elsewhere the system's defaults
            sock.setsockopt(socket.IPPROTO_TCP, getattr(socket, option), value)


# ------------------------------------------------------------------- engine replica's end
class LinkSink:
    """The engine replica's end of one link: where its channel's batches, and the items of
    the engine calls that came on it, are written."""

    def __init__(self, writer: asyncio.StreamWriter, options: frozenset[str] = frozenset()) -> None:
        self.writer = writer
        self.takes_calls = CALLS in options  # it sends engine calls; frames say what they hold
        self.calls: dict[str, asyncio.Task] = {}  # request id -> the call running it
        self.broken = False

    async def send(self, data: bytes) -> None:
        """Write one batch (waiting while the ingress is behind: later steps then come
        merged into fewer batches); ConnectionError once the link is broken."""
        if self.broken or self.writer.is_closing():
            raise ConnectionError("the delta link is closed")
        self.writer.write(frame(_BATCH + data if self.takes_calls else data))
        await self.writer.drain()

    def send_item(self, request_id: str, kind: str, payload: Any) -> None:
        """The next item of an engine call that came on this link (dropped once it broke:
        its calls are cancelled then)."""
        if not self.broken and not self.writer.is_closing():
            self.writer.write(frame(_ITEM + link_call.item_message(request_id, kind, payload)))

    def close(self) -> None:
        self.broken = True
        self.writer.close()
        for task in self.calls.values():  # nobody reads their items any more
            task.cancel()


class LinkListener:
    """The port an engine replica's delta links connect to. `on_lost(channel)` runs when a
    channel's link breaks (or its ingress closes it); `on_call(sink, message)` takes each
    message of the engine calls sent on a link (None: the links take no calls)."""

    def __init__(
        self,
        host: str,
        on_lost: Callable[[str], None],
        on_call: Callable[[LinkSink, tuple[Any, ...]], None] | None = None,
    ) -> None:
        self.host = host
        self.on_lost = on_lost
        self.on_call = on_call
        self.sinks: dict[str, LinkSink] = {}
        self.address: tuple[str, int] | None = None  # once listening
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        try:
            self._server = await asyncio.start_server(self._accept, self.host, 0)
        except OSError:
            logger.warning("no delta link port on %s: channels stay on Ray", self.host)
            return
        self.address = (self.host, self._server.sockets[0].getsockname()[1])

    async def _accept(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        tune(writer.get_extra_info("socket"))
        channel, sink = None, None
        try:
            hello = (await asyncio.wait_for(reader.readline(), CONNECT_TIMEOUT_S)).decode()
            channel, _, options = hello.strip().partition("\t")
            if not channel:
                return
            if (replaced := self.sinks.pop(channel, None)) is not None:
                # Its ingress connects again only once it lost that link (and failed the
                # requests on it): they end here too, rather than run for nobody.
                replaced.close()
                self.on_lost(channel)
            said = frozenset(options.split(","))
            if self.on_call is None:
                said -= {CALLS}
            sink = self.sinks[channel] = LinkSink(writer, said)
            writer.write(frame(CALLS.encode() if sink.takes_calls else b""))  # it may subscribe
            await writer.drain()
            while True:  # engine calls, until the link's end (an older ingress sends none)
                size = int.from_bytes(await reader.readexactly(_HEADER), "big")
                message = pickle.loads(await reader.readexactly(size))
                if self.on_call is not None:
                    self.on_call(sink, message)
        except (OSError, TimeoutError, UnicodeDecodeError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()
            if sink is not None and self.sinks.get(channel) is sink:
                sink.close()
                del self.sinks[channel]
                self.on_lost(channel)

    def close(self) -> None:
        if self._server is not None:
            self._server.close()
        for sink in self.sinks.values():
            sink.close()


# ------------------------------------------------------------------ ingress replica's end
class LinkReader(asyncio.Protocol):
    """The ingress's end of one link: each frame's batch to `on_batch`, each engine call's
    items to its LinkCall, the link's end (its exception, None when the engine replica
    closed it) to `on_lost` and to every call still open."""

    def __init__(
        self, on_batch: Callable[[bytes], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self.on_batch = on_batch
        self.on_lost = on_lost
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.num_frames = 0  # batches
        self.takes_calls = False  # the replica takes engine calls on it
        self.calls: dict[str, LinkCall] = {}  # request id -> its open call
        self.transport: asyncio.Transport | None = None
        self._buffer = bytearray()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's is no subclass)
        tune(transport.get_extra_info("socket"))

    def data_received(self, data: bytes) -> None:
        buffer = self._buffer
        buffer += data
        start = 0
        while len(buffer) - start >= _HEADER:
            end = start + _HEADER + int.from_bytes(buffer[start : start + _HEADER], "big")
            if len(buffer) < end:
                break
            body = bytes(buffer[start + _HEADER : end])
            start = end
            if not self.accepted.done():
                self.takes_calls = body == CALLS.encode()
                self.accepted.set_result(None)
                continue
            if self.takes_calls:
                if body[:1] == _ITEM:
                    request_id, kind, payload = pickle.loads(body[1:])
                    if (call := self.calls.get(request_id)) is not None:
                        call.deliver(kind, payload)
                    continue
                body = body[1:]
            self.num_frames += 1
            self.on_batch(body)
        del buffer[:start]

    def call(
        self,
        request_id: str,
        args: tuple[Any, ...],
        kwargs: dict[str, Any],
        on_end: Callable[[], None] = lambda: None,
    ) -> LinkCall:
        """An engine call sent on this link (its arguments plain data that pickles);
        `on_end` runs once it ended (its last item, its cancel, or the link's end)."""
        assert self.transport is not None and self.takes_calls
        message = link_call.call_message(request_id, args, kwargs)

        def cancel() -> None:
            if self.transport is not None and not self.transport.is_closing():
                self.transport.write(frame(link_call.cancel_message(request_id)))

        def ended() -> None:
            if self.calls.get(request_id) is call:
                del self.calls[request_id]
            on_end()

        call = self.calls[request_id] = LinkCall(cancel, ended)
        self.transport.write(frame(message))
        return call

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(exc or ConnectionError("the delta link was refused"))
        lost = DeltaLinkLost(f"the delta link broke: {exc!r}")
        for call in list(self.calls.values()):
            call.deliver("lost", lost)
        self.on_lost(exc)

    def close(self) -> None:
        if self.transport is not None:
            self.transport.close()


async def connect(
    address: tuple[str, int],
    channel: str,
    on_batch: Callable[[bytes], None],
    on_lost: Callable[[Exception | None], None],
) -> LinkReader | None:
    """A link reading `channel` from the engine replica at `address`, once the replica has
    it; None where it cannot be made (the channel then stays on Ray)."""
    loop = asyncio.get_running_loop()
    reader: LinkReader | None = None
    try:
        async with asyncio.timeout(CONNECT_TIMEOUT_S):
            transport, reader = await loop.create_connection(
                lambda: LinkReader(on_batch, on_lost), *address
            )
            transport.write(f"{channel}\t{CALLS}\n".encode())
            await reader.accepted
        return reader
    except (OSError, TimeoutError) as exc:
        logger.warning("no delta link to %s:%d (%r): that channel stays on Ray", *address, exc)
        if reader is not None:
            reader.on_lost = lambda _: None  # nothing was read through it
            reader.close()
        return None
