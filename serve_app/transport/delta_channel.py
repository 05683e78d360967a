"""Delta channels: one stream per (ingress replica, engine replica) for every request's deltas.

A Ray message costs milliseconds of CPU on each side (../shared/RAY_NOTES.md), and on a CPU
node that CPU comes out of the engine's forward. Streaming each request's deltas on its own
handle call sends one message per request per engine step; through a channel, an engine
step's deltas for one ingress replica travel together as one message. The request's own
handle call stays (Serve's routing, load accounting, cancellation on disconnect and 429s work
as before), but after its first delta it only waits for the request to end.

Engine side: `Outbox`, one per ingress replica's channel id, filled by that ingress's requests
and drained by its subscription (`EngineServer.subscribe`). Ingress side: `DeltaChannels`
keeps one subscription task per engine replica it has requests at, and hands each delta to
its request's queue. A step's deltas cross as bytes (`packed`: one pickle of a row of
field values per delta): Ray serializes a list of objects many times slower than pickle does
rows, and passes bytes as they are. Where the engine replica offers a delta link
(serve_app.transport.delta_link), those bytes go on a TCP connection instead, and the
subscription only starts and ends the draining.
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import pickle
import time
from collections import Counter
from collections.abc import AsyncIterator
from dataclasses import dataclass, fields
from operator import attrgetter

from ray.serve.handle import DeploymentHandle

from engine.core.outputs import RequestOutput
from serve_app.transport import delta_link
from serve_app.transport.delta_link import LinkSink
from serve_app.transport.delta_queue import DeltaQueue

logger = logging.getLogger(__name__)

# How long a subscription outlives the last open request of its channel at a replica: short,
# so a replica Serve is draining for shutdown is not held open by an idle subscription, and
# long enough that a steady stream of requests keeps one subscription.
SUBSCRIPTION_IDLE_S = 2.0
# Pause before subscribing again after a subscription that brought nothing.
_RETRY_S = 0.05
# Deltas nobody subscribed to for this long belong to an ingress replica that went away.
ABANDONED_AFTER_S = 120.0
# How often an engine replica asks whether the ingress replicas with open requests live.
OWNER_CHECK_S = 2.0


_row = attrgetter(*(f.name for f in fields(RequestOutput)))


def packed(batch: list[RequestOutput]) -> bytes:
    return pickle.dumps([_row(out) for out in batch], protocol=pickle.HIGHEST_PROTOCOL)


def unpacked(data: bytes | list[RequestOutput]) -> list[RequestOutput]:
    if isinstance(data, list):  # from an engine replica of the previous version (an update)
        return data
    return [RequestOutput(*row) for row in pickle.loads(data)]


def channel_name(owner: str, suffix: str) -> str:
    """A channel's id: the Serve actor name of the ingress replica that owns it (or "local"),
    then a suffix of its own."""
    return f"{owner}/{suffix}"


def _owner_alive(owner: str) -> bool:
    """Whether the named Serve actor still lives (a dead actor's name is released)."""
    import ray

    try:
        ray.get_actor(owner, namespace="serve")
    except ValueError:
        return False
    except Exception:  # the lookup itself failed: no reason to end anyone's requests
        logger.warning("could not look up %s", owner, exc_info=True)
    return True


@dataclass(frozen=True)
class ChannelledFirst:
    """First item of a request that streams through a channel: its first delta and the engine
    replica whose channel carries the rest."""

    output: RequestOutput
    replica_id: str
    link: tuple[str, int] | None = None  # where the replica's delta links connect


class Outbox:
    """Deltas waiting for one channel's subscription at an engine replica."""

    def __init__(self) -> None:
        self.items: list[RequestOutput] = []
        self.num_open = 0  # this channel's requests at the replica that have not ended
        self.num_subscribers = 0
        self.num_batches = 0
        self.num_deltas = 0
        # Its ingress replica died: its requests end (a dead caller's streams are never
        # closed by Ray, and the subscription at this end keeps reading into the void).
        self.owner_gone = False
        self._ready = asyncio.Event()
        self._last_read = time.monotonic()

    def put(self, out: RequestOutput) -> None:
        self.items.append(out)
        self._ready.set()

    async def take(self, idle_s: float = SUBSCRIPTION_IDLE_S) -> list[RequestOutput] | None:
        """Everything queued (at least one delta), or None once nothing was queued for idle_s
        and no request of the channel is open (the subscription may end)."""
        while not self.items:
            self._ready.clear()
            try:
                await asyncio.wait_for(self._ready.wait(), idle_s)
            except TimeoutError:
                if not self.items and self.num_open == 0:
                    return None
        items, self.items = self.items, []
        self._last_read = time.monotonic()
        self.num_batches += 1
        self.num_deltas += len(items)
        return items

    @property
    def unused(self) -> bool:
        """Idle (nothing queued or open) and nobody reading: the replica may drop it."""
        return not self.items and self.num_open == 0 and not self.num_subscribers

    @property
    def abandoned(self) -> bool:
        """Nothing open and no subscriber, with deltas unread for ABANDONED_AFTER_S."""
        return (
            self.num_open == 0
            and not self.num_subscribers
            and time.monotonic() - self._last_read > ABANDONED_AFTER_S
        )


class Outboxes:
    """An engine replica's end: one Outbox per channel id, opened by that channel's first
    open request or subscription, dropped once neither is left (or its ingress went away)."""

    def __init__(self) -> None:
        self._boxes: dict[str, Outbox] = {}
        self._batches_dropped = 0  # of outboxes already dropped
        self._deltas_dropped = 0
        self._link_batches = 0  # of all the batches, those sent on delta links

    def open(self, channel: str) -> Outbox:
        """A request of `channel` starts: its deltas go to the returned outbox."""
        for name, stale in list(self._boxes.items()):
            if stale.abandoned:  # its ingress went away without reading the rest
                self._drop(name, stale)
        outbox = self._boxes.setdefault(channel, Outbox())
        outbox.num_open += 1
        return outbox

    def close(self, channel: str, outbox: Outbox) -> None:
        outbox.num_open -= 1
        if outbox.unused:
            self._drop(channel, outbox)

    async def subscribe(self, channel: str, sink: LinkSink | None = None) -> AsyncIterator[bytes]:
        """`channel`'s deltas, one `packed` batch per engine step, until idle a while: on
        `sink` (its delta link) when given, else yielded."""
        outbox = self._boxes.setdefault(channel, Outbox())
        outbox.num_subscribers += 1
        try:
            while (batch := await outbox.take()) is not None:
                if sink is None:
                    yield packed(batch)
                    continue
                try:
                    await sink.send(packed(batch))
                except ConnectionError:  # the link's end (LinkListener) ends its requests
                    return
                self._link_batches += 1
        finally:
            outbox.num_subscribers -= 1
            if outbox.unused:
                self._drop(channel, outbox)

    def lost(self, channel: str) -> None:
        """`channel`'s delta link broke: its open requests end (their deltas may be lost on
        the way, and the ingress resumes them elsewhere); later ones get a new outbox."""
        outbox = self._boxes.get(channel)
        if outbox is not None:
            outbox.owner_gone = outbox.num_open > 0
            self._drop(channel, outbox)

    async def watch_owners(self, period_s: float = OWNER_CHECK_S) -> None:
        """Mark the outboxes of ingress replicas that died (checked every period_s)."""
        while True:
            await asyncio.sleep(period_s)
            owners: dict[str, list[Outbox]] = {}
            for channel, outbox in self._boxes.items():
                owner = channel.rpartition("/")[0]
                if outbox.num_open and owner.startswith("SERVE_REPLICA::"):
                    owners.setdefault(owner, []).append(outbox)
            for owner, outboxes in owners.items():
                if not await asyncio.to_thread(_owner_alive, owner):
                    logger.warning("ingress replica %s is gone: ending its requests", owner)
                    for outbox in outboxes:
                        outbox.owner_gone = True

    def _drop(self, channel: str, outbox: Outbox) -> None:
        if self._boxes.get(channel) is outbox:
            self._batches_dropped += outbox.num_batches
            self._deltas_dropped += outbox.num_deltas
            del self._boxes[channel]

    def stats(self) -> dict[str, int]:
        boxes = self._boxes.values()
        return {
            "num_channels": len(self._boxes),
            "channel_batches_total": self._batches_dropped + sum(o.num_batches for o in boxes),
            "channel_deltas_total": self._deltas_dropped + sum(o.num_deltas for o in boxes),
            "channel_link_batches_total": self._link_batches,
        }


class DeltaChannels:
    """The ingress's end: each request's deltas on a queue of its own, fed by one subscription
    per engine replica that has open requests of this ingress."""

    def __init__(
        self,
        engine: DeploymentHandle,
        channel_id: str,
        max_unsent_tokens: int | None = None,
        links: bool = True,
    ) -> None:
        """`links`: read each engine replica's batches on a delta link where it offers one
        (serve_app.transport.delta_link), else every batch through the subscription."""
        self.channel_id = channel_id
        self.max_unsent_tokens = max_unsent_tokens  # per request; None: no bound
        self.use_links = links
        self._subscribe = engine.options(stream=True).subscribe
        self._queues: dict[str, DeltaQueue] = {}
        self._replica_of: dict[str, str] = {}
        self._open_at: Counter[str] = Counter()  # replica id -> open requests
        self._tasks: dict[str, asyncio.Task] = {}  # replica id -> its subscription
        self._link_at: dict[str, tuple[str, int]] = {}  # replica id -> its links' address
        self._links: dict[str, delta_link.LinkReader] = {}  # replica id -> the open link
        self.num_links_lost = 0  # with requests open on them
        # What the path costs per engine step (/metrics): messages taken, deltas they held,
        # and wake-ups of the responses reading them (RequestStream counts its own).
        self.num_messages = 0
        self.num_deltas = 0
        self.num_wakeups = 0

    def call_link(self, replica_id: str) -> delta_link.LinkReader | None:
        """The open delta link to replica_id, where it takes engine calls."""
        link = self._links.get(replica_id)
        return link if link is not None and link.takes_calls else None

    def open(self, request_id: str) -> DeltaQueue:
        """The request's queue; open it before the request is sent so no delta is missed."""
        queue = DeltaQueue(self.max_unsent_tokens)
        self._queues[request_id] = queue
        return queue

    def attach(self, request_id: str, replica_id: str, link: tuple[str, int] | None = None) -> None:
        """The request runs at replica_id (whose delta links connect to `link`): make sure
        this ingress listens to its channel there."""
        if request_id not in self._queues:
            return  # closed already
        if link is not None and self.use_links:
            self._link_at[replica_id] = link
        self._replica_of[request_id] = replica_id
        self._open_at[replica_id] += 1
        if replica_id not in self._tasks:
            # Not a child call of the request starting it (Serve cancels those as clients leave).
            task = asyncio.get_running_loop().create_task(
                self._listen(replica_id), context=contextvars.Context()
            )
            self._tasks[replica_id] = task

    def fail(self, request_id: str, exc: BaseException) -> None:
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(exc)

    def close(self, request_id: str) -> None:
        """The request ended here. Its replica's subscription stays (the replica ends it once
        idle): cancelling it would drop the batches on their way, other requests' deltas."""
        queue = self._queues.pop(request_id, None)
        if queue is not None:
            queue.close()
        replica_id = self._replica_of.pop(request_id, None)
        if replica_id is not None:
            self._open_at[replica_id] -= 1
            if self._open_at[replica_id] <= 0:
                del self._open_at[replica_id]

    def _deliver(self, data: bytes) -> None:
        """One batch (from the subscription or the link) to its requests' queues."""
        batch = unpacked(data)
        self.num_messages += 1
        self.num_deltas += len(batch)
        for out in batch:
            queue = self._queues.get(out.request_id)
            if queue is not None:
                queue.put_nowait(out)

    async def _link(self, replica_id: str) -> delta_link.LinkReader | None:
        """The open link to replica_id, connected first where it offers one; None: read
        through the subscription."""
        link = self._links.get(replica_id)
        address = self._link_at.get(replica_id)
        if link is None and address is not None:

            def lost(exc: Exception | None) -> None:
                self._link_lost(replica_id, link, exc)

            link = await delta_link.connect(address, self.channel_id, self._deliver, lost)
            if link is None:
                del self._link_at[replica_id]  # not again: its subscription brings the batches
            else:
                self._links[replica_id] = link
        return link

    def _link_lost(
        self, replica_id: str, link: delta_link.LinkReader | None, exc: Exception | None
    ) -> None:
        """Deltas may have been lost with it: the requests open at replica_id fail as when a
        replica dies (they resume elsewhere) and the replica aborts its end of them."""
        if link is not None and self._links.get(replica_id) is link:
            del self._links[replica_id]
        failed = [r for r, at in self._replica_of.items() if at == replica_id]
        if failed:
            self.num_links_lost += 1
            logger.warning(
                "delta link to %s broke (%r): %d requests resume", replica_id, exc, len(failed)
            )
        error = delta_link.DeltaLinkLost(f"the delta link to engine replica {replica_id} broke")
        for request_id in failed:
            self.fail(request_id, error)

    async def _listen(self, replica_id: str) -> None:
        """Subscribe to replica_id's outbox for this channel while requests are open there
        (the replica ends a subscription that stays idle; if requests came meanwhile, subscribe
        again). A failed subscription fails that replica's open requests."""
        stream = None
        try:
            while self._open_at[replica_id] > 0:
                link = await self._link(replica_id)
                frames = link.num_frames if link is not None else 0
                # (Asked only of replicas that offer links: those of an older version take
                # no such argument.)
                linked = {"link": True} if link is not None else {}
                stream = self._subscribe.remote(self.channel_id, replica_id=replica_id, **linked)
                delivered = False
                async for data in stream:
                    delivered = True
                    self._deliver(data)
                stream = None
                delivered |= link is not None and link.num_frames > frames
                if not delivered:  # it reached another replica: try again shortly
                    await asyncio.sleep(_RETRY_S)
        except BaseException as exc:  # the replica died or is unreachable, or this ingress stops
            logger.warning("delta channel to %s failed: %r", replica_id, exc)
            # Its requests fail rather than wait for deltas nobody will read any more.
            error = exc if isinstance(exc, Exception) else ConnectionError(f"{exc!r}")
            for request_id, at in list(self._replica_of.items()):
                if at == replica_id:
                    self.fail(request_id, error)
            if error is not exc:
                raise
        finally:
            if stream is not None:
                stream.cancel()
            if self._tasks.get(replica_id) is asyncio.current_task():
                del self._tasks[replica_id]
