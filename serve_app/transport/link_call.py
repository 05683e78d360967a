"""Link calls: an engine call (`EngineServer.generate`) sent on the delta link the ingress
already holds to the chosen engine replica, instead of as a Ray actor call.

A Ray actor call and the replica's dispatch of it take milliseconds before the engine sees
the request, and its first item as long again on the way back (reports/notebook.md); a frame
each way on an open connection takes a fraction of one. What the call does stays: the same
router picks the replica and counts the call in its queue-length cache while it runs, the
replica counts it among Serve's ongoing requests (so Serve's graceful shutdown waits for it),
its items (rejections, the first delta, a moved sequence's KV) come in order, and cancelling
it aborts the engine request. A link that breaks fails its open calls (DeltaLinkLost: the
requests resume elsewhere) and the replica cancels them.

Only plain data crosses (an ObjectRef pickled outside Ray loses its owner): a moved
sequence's KV goes back as its offer on the replica's KV link, and a resumed sequence whose
KV is in Ray's object store is sent as a Ray call.

Messages, ingress to replica (one pickle per frame): ("call", request_id, args, kwargs) and
("cancel", request_id). Replica to ingress: (request_id, kind, payload), kind "item" (the
next item), "end" (no more) or "error" (the call's exception).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractContextManager
from typing import Any, Protocol

logger = logging.getLogger(__name__)


def call_message(request_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bytes:
    return pickle.dumps(("call", request_id, args, kwargs), protocol=pickle.HIGHEST_PROTOCOL)


def cancel_message(request_id: str) -> bytes:
    return pickle.dumps(("cancel", request_id), protocol=pickle.HIGHEST_PROTOCOL)


def item_message(request_id: str, kind: str, payload: Any) -> bytes:
    try:
        return pickle.dumps((request_id, kind, payload), protocol=pickle.HIGHEST_PROTOCOL)
    except Exception:  # an exception that does not pickle: its description does
        error = RuntimeError(f"{type(payload).__name__}: {payload}")
        return pickle.dumps((request_id, "error", error), protocol=pickle.HIGHEST_PROTOCOL)


# ------------------------------------------------------------------ ingress replica's end
class LinkCall:
    """One call's items as they come off the link (as a handle call's: `anext`, `async for`,
    `cancel`). `on_cancel` sends the replica the cancel; `on_end` runs once it ended."""

    def __init__(self, on_cancel: Callable[[], None], on_end: Callable[[], None]) -> None:
        # (A few items a call, so asyncio's queue: its cost per item is not on the token path.)
        self._items: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        self._on_cancel = on_cancel
        self._on_end: Callable[[], None] | None = on_end
        self.ended = False  # its last message came, or it was cancelled
        self._read_last = False

    def __aiter__(self) -> LinkCall:
        return self

    async def __anext__(self) -> Any:
        if self._read_last:
            raise StopAsyncIteration
        kind, payload = await self._items.get()
        if kind == "item":
            return payload
        self._read_last = True
        if kind == "end":
            raise StopAsyncIteration
        raise payload  # "error", or the link's end

    def deliver(self, kind: str, payload: Any) -> None:
        """The next message of the call (kind "lost": the link broke, payload its error)."""
        if not self.ended:
            self._items.put_nowait((kind, payload))
            if kind != "item":
                self._end()

    def cancel(self) -> None:
        if not self.ended:
            self._on_cancel()
            self.deliver("end", None)

    def _end(self) -> None:
        self.ended = True
        on_end, self._on_end = self._on_end, None
        if on_end is not None:
            on_end()


# ------------------------------------------------------------------- engine replica's end
class ItemSink(Protocol):
    """Where a call's items go (the link's engine end, LinkSink)."""

    calls: dict[str, asyncio.Task]

    def send_item(self, request_id: str, kind: str, payload: Any) -> None: ...


class LinkCallServer:
    """The engine replica's end: runs each call that comes on a link as the replica's own
    method, its items back on the same link."""

    def __init__(
        self,
        generate: Callable[..., AsyncIterator[Any]],
        counted: Callable[[], AbstractContextManager[None]],
    ) -> None:
        """`counted`: a request among Serve's ongoing ones while it runs."""
        self.generate = generate
        self.counted = counted
        self.num_calls = 0

    def on_message(self, sink: ItemSink, message: tuple[Any, ...]) -> None:
        if message[0] == "call":
            _, request_id, args, kwargs = message
            task = asyncio.get_running_loop().create_task(
                self._serve(sink, request_id, args, kwargs)
            )
            sink.calls[request_id] = task
            self.num_calls += 1
        elif message[0] == "cancel" and (task := sink.calls.pop(message[1], None)) is not None:
            task.cancel()

    async def _serve(
        self, sink: ItemSink, request_id: str, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> None:
        try:
            with self.counted():
                async with contextlib.aclosing(self.generate(*args, **kwargs)) as items:
                    async for item in items:
                        sink.send_item(request_id, "item", item)
            sink.send_item(request_id, "end", None)
        except Exception as exc:  # (cancelled: the ingress or the link went, nobody to tell)
            logger.exception("request %s failed", request_id)
            sink.send_item(request_id, "error", exc)
        finally:
            if sink.calls.get(request_id) is asyncio.current_task():
                del sink.calls[request_id]
