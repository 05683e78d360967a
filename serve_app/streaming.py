"""A request's deltas on their way from an engine replica to the client: the per-request
stream (its own handle call, or its queue on a delta channel) and the SSE framing."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import RequestOutput, merge_queued
from serve_app import openai_protocol as oai
from serve_app.delta_channel import DeltaChannels
from serve_app.logprobs_format import LogprobsFormatter


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


class RequestStream:
    """The deltas of one request after its first: from its delta channel's queue when it has
    one (its handle call then only reports failures), else from the handle call itself.
    Stopping early (client gone, error) cancels the engine request; `close` always runs."""

    def __init__(self, request_id: str, channels: DeltaChannels | None) -> None:
        self.request_id = request_id
        self.channels = channels
        # Opened before the call starts: the channel may deliver before the call returns.
        self.queue: asyncio.Queue[RequestOutput | BaseException] | None = (
            channels.open(request_id) if channels is not None else None
        )
        self.call: Any = None  # the engine call's response stream, set by its starter

    @property
    def channel_id(self) -> str | None:
        return self.channels.channel_id if self.channels is not None else None

    def attach(self, replica_id: str) -> None:
        """The engine replica streams the rest through its channel."""
        assert self.channels is not None
        self.channels.attach(self.request_id, replica_id)

    def on_call(self) -> None:
        """The engine replica streams the rest on the call itself (no channel there)."""
        self.close()
        self.queue = None

    def close(self) -> None:
        if self.queue is not None and self.channels is not None:
            self.channels.close(self.request_id)

    async def deltas(self, first: RequestOutput) -> AsyncIterator[RequestOutput]:
        done = False
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
                    yield out
                    done = out.finished
        finally:
            if not done:
                self.call.cancel()
            self.close()

    async def _channelled(
        self, queue: asyncio.Queue[RequestOutput | BaseException]
    ) -> AsyncIterator[RequestOutput]:
        watcher = asyncio.get_running_loop().create_task(self._watch())
        try:
            while True:
                item = merge_queued(await queue.get(), queue)
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            watcher.cancel()

    async def _watch(self) -> None:
        """Its replica died before the channel delivered the end: fail the request."""
        try:
            async for _ in self.call:
                pass
        except Exception as exc:
            assert self.channels is not None
            self.channels.fail(self.request_id, exc)


def sse(data: Any) -> str:
    return f"data: {json.dumps(data)}\n\n"


async def sse_events(
    prep: Prepared,
    model: str,
    deltas: AsyncIterator[RequestOutput],
    first: RequestOutput,
    record: Callable[[RequestOutput], None],
) -> AsyncIterator[str]:
    """OpenAI's stream: chunks, an optional usage chunk, then `data: [DONE]`; an engine error
    is an error event, never a cut stream. `record(last)` runs once the deltas end."""
    chat = prep.endpoint == "chat"
    base = {
        "id": prep.request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": oai.now(),
        "model": model,
    }
    if prep.include_usage:
        base["usage"] = None
    last = first

    def event(choices: list[dict[str, Any]]) -> str:
        chunk = base | {"choices": choices}
        if prep.continuous_usage:  # usage so far on every chunk (vLLM's extension)
            chunk["usage"] = oai.usage(last.num_prompt_tokens, last.num_output_tokens)
        return sse(chunk)

    if chat:
        yield event([oai.chat_delta_choice({"role": "assistant", "content": ""}, None)])
    async with contextlib.aclosing(deltas) as outs:
        async for out in outs:
            last = out
            if out.finish_reason == "error":
                yield sse(oai.error_body(f"engine error: {out.error}", "server_error"))
                break
            finish = out.finish_reason if out.finished else None
            logprobs = (
                prep.logprobs.format(out.new_token_ids, out.logprobs) if prep.logprobs else None
            )
            if chat:
                if out.new_text or logprobs:
                    delta = {"content": out.new_text}
                    yield event([oai.chat_delta_choice(delta, None, logprobs)])
                if finish:
                    yield event([oai.chat_delta_choice({}, finish)])
            elif out.new_text or finish or logprobs:
                yield event([oai.completion_choice(out.new_text, finish, logprobs)])
    record(last)
    if prep.include_usage and last.finish_reason != "error":
        usage = oai.usage(last.num_prompt_tokens, last.num_output_tokens)
        yield sse(base | {"choices": [], "usage": usage})
    yield "data: [DONE]\n\n"


async def whole_body(
    prep: Prepared, model: str, deltas: AsyncIterator[RequestOutput], first: RequestOutput
) -> tuple[dict[str, Any], RequestOutput]:
    """The non-streamed response body from all deltas, and the last delta."""
    text, last, token_ids, token_logprobs = [], first, [], []
    async with contextlib.aclosing(deltas) as outs:
        async for out in outs:
            text.append(out.new_text)
            token_ids += out.new_token_ids
            token_logprobs += out.logprobs or []
            last = out
    base = {"id": prep.request_id, "created": oai.now(), "model": model}
    content = "".join(text)
    logprobs = prep.logprobs.format(token_ids, token_logprobs) if prep.logprobs else None
    if prep.endpoint == "chat":
        choice = oai.chat_choice(content, last.finish_reason, logprobs)
        body = base | {"object": "chat.completion", "choices": [choice]}
    else:
        choice = oai.completion_choice(content, last.finish_reason, logprobs)
        body = base | {"object": "text_completion", "choices": [choice]}
    body["usage"] = oai.usage(last.num_prompt_tokens, last.num_output_tokens)
    return body, last


async def closing(events: AsyncIterator[str], scope: contextlib.ExitStack) -> AsyncIterator[str]:
    """The events, then `scope` closed (a request's span ended), also when the client leaves
    early. (Module level in this module: Serve pickles the ingress class as its module is
    imported, so the ingress may only use names defined before it.)"""
    with scope:
        async with contextlib.aclosing(events) as inner:
            async for event in inner:
                yield event
