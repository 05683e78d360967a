"""Delta links: a delta channel's batches on a TCP connection from the engine replica to the
ingress replica, instead of one Ray message per engine step.

Taking a streaming generator's item costs the receiver's process about ten times the CPU of
reading a frame off a socket (reports/notebook.md, session 51), and the ingress takes one per
engine step per engine replica. The channel's subscription (serve_app.transport.delta_channel)
stays a Ray call: it starts and ends the engine replica's draining of the outbox, its failure
is the replica's, and Serve routes it; only the batches move to the link.

The ingress replica connects to the port the engine replica listens on (its node's address,
in each request's ChannelledFirst), says which channel it reads (and that it takes a
request's first delta on the link too: FIRSTS), and gets an empty frame back once the replica
has it; each frame after that is one `packed` batch, 4 bytes of length first. A link that
breaks, or whose peer stops answering (keepalive probes, and unacknowledged data, time out
after LINK_DEAD_AFTER_S), ends the open requests of its channel at both ends: the engine
replica aborts them (their blocks come back) and the ingress resumes them from the tokens
their clients have, as when a replica dies. An ingress that cannot connect reads the
batches from the subscription as before.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Callable

logger = logging.getLogger(__name__)

# A link whose peer has not acknowledged data, or answered keepalive probes, this long is
# broken (a partition, a node gone), not slow.
LINK_DEAD_AFTER_S = 5
# How long an ingress waits for an engine replica to accept its link before reading the
# channel through Ray instead.
CONNECT_TIMEOUT_S = 2.0
_HEADER = 4  # bytes of a frame's length
# Said after the channel's id (a tab between) by an ingress that reads a request's first
# delta from the link, where the replica puts it there: an ingress of an older version,
# which takes it from the request's call only, does not say it.
FIRSTS = "firsts"


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
    """The engine replica's end of one link: where its channel's batches are written."""

    def __init__(self, writer: asyncio.StreamWriter, firsts: bool = False) -> None:
        self.writer = writer
        self.firsts = firsts  # its ingress reads requests' first deltas from it too
        self.broken = False

    async def send(self, data: bytes) -> None:
        """Write one batch (waiting while the ingress is behind: later steps then come
        merged into fewer batches); ConnectionError once the link is broken."""
        if self.broken or self.writer.is_closing():
            raise ConnectionError("the delta link is closed")
        self.writer.write(frame(data))
        await self.writer.drain()

    def close(self) -> None:
        self.broken = True
        self.writer.close()


class LinkListener:
    """The port an engine replica's delta links connect to. `on_lost(channel)` runs when a
    channel's link breaks (or its ingress closes it)."""

    def __init__(self, host: str, on_lost: Callable[[str], None]) -> None:
        self.host = host
        self.on_lost = on_lost
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
            sink = self.sinks[channel] = LinkSink(writer, FIRSTS in options.split(","))
            writer.write(frame(b""))  # it may subscribe now
            await writer.drain()
            while await reader.read(1 << 12):  # it sends nothing more: this waits for its end
                pass
        except (OSError, TimeoutError, UnicodeDecodeError):
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
    """The ingress's end of one link: each frame's batch to `on_batch`, the link's end (its
    exception, None when the engine replica closed it) to `on_lost`."""

    def __init__(
        self, on_batch: Callable[[bytes], None], on_lost: Callable[[Exception | None], None]
    ) -> None:
        self.on_batch = on_batch
        self.on_lost = on_lost
        self.accepted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.num_frames = 0
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
                self.accepted.set_result(None)
                continue
            self.num_frames += 1
            self.on_batch(body)
        del buffer[:start]

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(exc or ConnectionError("the delta link was refused"))
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
            transport.write(f"{channel}\t{FIRSTS}\n".encode())
            await reader.accepted
        return reader
    except (OSError, TimeoutError) as exc:
        logger.warning("no delta link to %s:%d (%r): that channel stays on Ray", *address, exc)
        if reader is not None:
            reader.on_lost = lambda _: None  # nothing was read through it
            reader.close()
        return None
