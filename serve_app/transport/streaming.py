"""A request's deltas on their way from an engine replica to the ingress: the per-request
stream (its own handle call, or its queue on a delta channel)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace
from typing import Any

from engine.core.outputs import RequestOutput, merge_queued
from serve_app.openai.logprobs_format import LogprobsFormatter
from serve_app.openai.tool_calls import ToolPlan
from serve_app.transport.delta_channel import DeltaChannels
from serve_app.transport.delta_link import DeltaLinkLost
from serve_app.transport.delta_queue import DeltaQueue
from serve_app.transport.engine_rejection import EngineRejection
from serve_app.transport.moved_sequence import MOVED, MovedOut, SequenceLeft

logger = logging.getLogger(__name__)

# How long a request's delta channel may take to bring its last delta once the engine
# replica's call for it has ended (normally milliseconds; a subscription being set up again
# under load takes a few seconds).
CHANNEL_END_GRACE_S = 30.0

# How long the ingress waits for a moved sequence's KV ObjectRef before resuming it without.
MOVED_KV_WAIT_S = 10.0

# The task that runs a streamed response (its route handler's): cancelling it closes the
# connection. The tasks sending the response and pumping its choices (n > 1) inherit it.
response_task: contextvars.ContextVar[asyncio.Task | None] = contextvars.ContextVar(
    "response_task", default=None
)


def runs_response() -> None:
    """The calling task runs a streamed response (its route handler)."""
    response_task.set(asyncio.current_task())


@dataclass
class Prepared:
    """A validated request, ready for an engine replica."""

    request_id: str
    prompt_token_ids: list[int]
    params: Any  # SamplingParams
    endpoint: str  # "chat" | "completions"
    include_usage: bool
    continuous_usage: bool
    started: float = field(default_factory=time.perf_counter)
    logprobs: LogprobsFormatter | None = None  # when the request asks for them
    n: int = 1  # choices in the response
    echo_text: str | None = None  # completions' `echo`: the prompt, before each choice's text
    tools: ToolPlan | None = None  # chat: how the output becomes tool calls
    reasoning: bool = False  # chat: a leading <think>...</think> is reasoning_content
    lora: tuple[str, str] | None = None  # the LoRA adapter it runs with: (name, directory)


class RequestStream:
    """The deltas of one request after its first: from its delta channel's queue when it has
    one (its handle call then only reports failures), else from the handle call itself.
    Stopping early (client gone, error) cancels the engine request; `close` always runs."""

    def __init__(self, request_id: str, channels: DeltaChannels | None) -> None:
        self.request_id = request_id
        self.channels = channels
        # Opened before the call starts: the channel may deliver before the call returns.
        self.queue: DeltaQueue | None = channels.open(request_id) if channels is not None else None
        self.call: Any = None  # the engine call's response stream, set by its starter
        # Where a moved sequence's KV is (its call's MovedOut), read from the call by `_watch`.
        self._moved: asyncio.Future[Any] | None = None
        self._watcher: asyncio.Task | None = None

    @property
    def channel_id(self) -> str | None:
        return self.channels.channel_id if self.channels is not None else None

    def attach(self, replica_id: str, link: tuple[str, int] | None = None) -> None:
        """The engine replica streams the rest through its channel (on a delta link to
        `link`, where it offers one)."""
        assert self.channels is not None
        self.channels.attach(self.request_id, replica_id, link)

    def on_call(self) -> None:
        """The engine replica streams the rest on the call itself (no channel there)."""
        self.close()
        self.queue = None

    def close(self) -> None:
        if self.queue is not None and self.channels is not None:
            self.channels.close(self.request_id)

    async def deltas(self, first: RequestOutput) -> AsyncIterator[RequestOutput]:
        done = False
        reader = response_task.get()
        if self.queue is not None and reader is not None:
            # Only a streamed response waits for its client; a whole one takes every delta
            # as it comes (ending it here would leave it waiting for deltas dropped).
            self.queue.on_overflow = self._not_read(reader)
        try:
            yield first
            done = first.finished
            if done:  # a one-token request: nothing follows on its channel
                return
            rest = (
                contextlib.nullcontext(self.call)
                if self.queue is None
                else contextlib.aclosing(self._channelled(self.queue))
            )
            async with rest as later:
                async for out in later:
                    if out.finish_reason == MOVED:  # the replica is stopping (moved_sequence)
                        done = True  # its call holds the KV until the sequence goes on
                        if out.new_token_ids:
                            yield replace(out, finished=False, finish_reason=None)
                        raise SequenceLeft(self.request_id, self._moved_kv())
                    yield out
                    done = out.finished
        finally:
            if not done:
                self.call.cancel()
            self.close()

    def _not_read(self, reader: asyncio.Task) -> Callable[[int], None]:
        """What ends the request once its client stops reading: the engine request is
        aborted, and `reader` (the task running its streamed response, waiting on a send the
        client does not take) is cancelled, which closes the connection."""

        def overflow(num_tokens: int) -> None:
            logger.warning(
                "request %s: %d tokens wait for a client that does not read; ending it",
                self.request_id,
                num_tokens,
            )
            self.call.cancel()
            self.close()
            reader.cancel()

        return overflow

    async def _moved_kv(self) -> Any:
        """A moved sequence's KV ObjectRef, from its call's MovedOut; None where that does
        not come (its replica died meanwhile: the context is computed again)."""
        try:
            if self._moved is not None:  # the channel's watcher reads the call
                return await asyncio.wait_for(asyncio.shield(self._moved), MOVED_KV_WAIT_S)
            item = await asyncio.wait_for(anext(self.call), MOVED_KV_WAIT_S)
            return item.kv if isinstance(item, MovedOut) else None
        except Exception as exc:
            logger.warning("request %s: its moved KV did not come (%r)", self.request_id, exc)
            return None

    async def _channelled(self, queue: DeltaQueue) -> AsyncIterator[RequestOutput]:
        assert self.channels is not None
        self._moved = asyncio.get_running_loop().create_future()
        # Kept on the stream: after a move it outlives this generator, reading the MovedOut.
        self._watcher = watcher = asyncio.get_running_loop().create_task(self._watch())
        moved = False
        try:
            while True:
                item = await queue.get()
                self.channels.num_wakeups += 1
                item = merge_queued(item, queue)
                if isinstance(item, BaseException):
                    raise item
                moved = item.finish_reason == MOVED
                yield item
                if item.finished:
                    return
        finally:
            if not moved:  # else it is reading the call's MovedOut
                watcher.cancel()

    def _settle_moved(self, kv: Any) -> None:
        if self._moved is not None and not self._moved.done():
            self._moved.set_result(kv)

    async def _watch(self) -> None:
        """Its replica died before the channel delivered the end, its delta link broke (the
        replica says so on the call: the request resumes), or the channel did not bring the
        end it had (the replica queues a request's last delta before its call ends): fail the
        request rather than leave its client waiting."""
        assert self.channels is not None and self.queue is not None
        try:
            async for item in self.call:
                if isinstance(item, MovedOut):
                    self._settle_moved(item.kv)
                    return  # the call stays open, holding the KV, until it is cancelled
                if isinstance(item, EngineRejection):  # its delta link broke there
                    self._settle_moved(None)
                    self.channels.fail(self.request_id, DeltaLinkLost(item.message))
                    return
        except Exception as exc:
            self._settle_moved(None)
            self.channels.fail(self.request_id, exc)
            return
        self._settle_moved(None)
        deadline = time.monotonic() + CHANNEL_END_GRACE_S
        while not self.queue.ended and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        if not self.queue.ended:
            logger.error("request %s: its delta channel lost its end", self.request_id)
            lost = ConnectionError("the engine replica's deltas for this request were lost")
            self.channels.fail(self.request_id, lost)
