"""OpenAI's response bodies from the deltas of a request's sequences (its choices): the SSE
stream, chunk by chunk, or the whole body; with `best_of`, the `n` most likely sequences."""

from __future__ import annotations

import asyncio
import contextlib
import copy
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

from engine.core.outputs import RequestOutput, TokenLogprob
from serve_app.openai import protocol as oai
from serve_app.openai.chat_deltas import ChatDeltas, whole_message
from serve_app.openai.errors import OpenAIError
from serve_app.openai.logprobs_format import LogprobsFormatter
from serve_app.openai.sse_chunks import ChunkEncoder, sse
from serve_app.transport.streaming import Prepared


@dataclass
class Choice:
    """One sequence of a request: its first delta and the stream of all its deltas (which
    yields the first again)."""

    index: int
    first: RequestOutput
    deltas: AsyncIterator[RequestOutput]
    last: RequestOutput = field(init=False)

    def __post_init__(self) -> None:
        self.last = self.first


# `record(lasts)`: a request's metrics and span, from the last delta of each of its choices.
Recorder = Callable[[list[RequestOutput]], None]


def _usage(choices: list[Choice]) -> dict[str, int]:
    """The prompt once, the completions of every sequence generated (best_of's too)."""
    prompt = choices[0].last.num_prompt_tokens
    return oai.usage(prompt, sum(c.last.num_output_tokens for c in choices))


def _formatters(prep: Prepared, count: int) -> list[LogprobsFormatter | None]:
    # A formatter carries its sequence's text offset: one per choice.
    return [copy.copy(prep.logprobs) if prep.logprobs else None for _ in range(count)]


def _echoed(prep: Prepared, choice: Choice, formatter: LogprobsFormatter) -> dict | None:
    """The echoed prompt's logprobs (completions' shape), from the choice's first delta."""
    return formatter.format(prep.prompt_token_ids, choice.first.prompt_logprobs)


def _joined(head: dict | None, tail: dict | None) -> dict | None:
    """Two completions logprobs objects, one after the other."""
    if head is None or tail is None:
        return head or tail
    return {key: head[key] + tail[key] for key in head}


async def merged(choices: list[Choice]) -> AsyncIterator[tuple[Choice, RequestOutput]]:
    """Every choice's deltas as they come; stopping early (client gone, error) stops them all
    (each cancels its engine request). A choice's next delta is taken only once its last was
    consumed, so the deltas of a client that reads slowly wait (and merge) in their channel
    queues, where their bound applies (api.max_unsent_tokens)."""
    if len(choices) == 1:
        async with contextlib.aclosing(choices[0].deltas) as outs:
            async for out in outs:
                yield choices[0], out
        return
    queue: asyncio.Queue[tuple[Choice, RequestOutput | BaseException | None]] = asyncio.Queue()
    consumed = [asyncio.Event() for _ in choices]

    async def pump(choice: Choice) -> None:
        try:
            async with contextlib.aclosing(choice.deltas) as outs:
                async for out in outs:
                    queue.put_nowait((choice, out))
                    await consumed[choice.index].wait()
                    consumed[choice.index].clear()
        except Exception as exc:
            queue.put_nowait((choice, exc))
        finally:
            queue.put_nowait((choice, None))

    tasks = [asyncio.get_running_loop().create_task(pump(c)) for c in choices]
    try:
        running = len(tasks)
        while running:
            choice, item = await queue.get()
            if item is None:
                running -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield choice, item
                consumed[choice.index].set()
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def sse_events(
    prep: Prepared, model: str, choices: list[Choice], record: Recorder
) -> AsyncIterator[str]:
    """OpenAI's stream: chunks (one choice each, by index), an optional usage chunk, then
    `data: [DONE]`; an engine error is an error event, never a cut stream. `record` runs once
    the deltas end."""
    chat = prep.endpoint == "chat"
    base = {
        "id": prep.request_id,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": oai.now(),
        "model": model,
    }
    if prep.include_usage:
        base["usage"] = None
    formatters = _formatters(prep, len(choices))
    messages = [ChatDeltas(prep.tools, prep.reasoning) for _ in choices] if chat else []
    failed = False
    encoder = ChunkEncoder(base)
    # Chunks written from templates: no usage on each (vLLM's continuous usage), no logprobs.
    plain = not prep.continuous_usage and prep.logprobs is None

    def event(choice: dict[str, Any]) -> str:
        if prep.continuous_usage:  # usage so far on every chunk (vLLM's extension)
            return sse(base | {"choices": [choice], "usage": _usage(choices)})
        return encoder.event(choice)

    def chunks(c: Choice, out: RequestOutput) -> list[str]:
        """The events of one delta of choice `c`."""
        finish = out.finish_reason if out.finished else None
        if plain and not chat:
            return [encoder.text(c.index, out.new_text, finish)] if out.new_text or finish else []
        formatter = formatters[c.index]
        logprobs = formatter.format(out.new_token_ids, out.logprobs) if formatter else None
        if not chat:
            if out.new_text or finish or logprobs:
                return [event(oai.completion_choice(c.index, out.new_text, finish, logprobs))]
            return []
        message = messages[c.index]
        deltas = message.feed(out.new_text, finish is not None)
        if plain and not finish and len(deltas) == 1 and deltas[0].keys() == {"content"}:
            return [encoder.content(c.index, deltas[0]["content"])]
        if logprobs and not deltas:
            deltas = [{"content": ""}]
        events = [
            event(oai.chat_delta_choice(c.index, delta, None, logprobs if i == 0 else None))
            for i, delta in enumerate(deltas)
        ]
        if finish:
            reason = message.finish_reason(finish)
            events.append(event(oai.chat_delta_choice(c.index, {}, reason)))
        return events

    for c in choices:
        if chat:
            yield event(oai.chat_delta_choice(c.index, {"role": "assistant", "content": ""}, None))
        elif prep.echo_text is not None:
            formatter = formatters[c.index]
            logprobs = _echoed(prep, c, formatter) if formatter else None
            yield event(oai.completion_choice(c.index, prep.echo_text, None, logprobs))
    try:
        async with contextlib.aclosing(merged(choices)) as outs:
            async for c, out in outs:
                c.last = out
                if out.finish_reason == "error":
                    failed = True
                    yield sse(oai.error_body(f"engine error: {out.error}", "server_error"))
                    break
                for chunk in chunks(c, out):
                    yield chunk
    except OpenAIError as exc:  # lost with its replica: an error event, never a cut stream
        failed = True
        yield sse(oai.error_body(exc.message, exc.err_type, exc.param, exc.code))
    record([c.last for c in choices])
    if prep.include_usage and not failed:
        yield sse(base | {"choices": [], "usage": _usage(choices)})
    yield "data: [DONE]\n\n"


@dataclass
class _Sequence:
    text: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)

    @property
    def cumulative_logprob(self) -> float:
        return sum(lp.logprob for lp in self.logprobs)


async def whole_body(
    prep: Prepared, model: str, choices: list[Choice]
) -> tuple[dict[str, Any], list[RequestOutput]]:
    """The non-streamed body from every choice's deltas (with `best_of`, the `prep.n` most
    likely sequences, re-indexed), and the last delta of each choice."""
    sequences = [_Sequence() for _ in choices]
    async with contextlib.aclosing(merged(choices)) as outs:
        async for c, out in outs:
            seq = sequences[c.index]
            seq.text.append(out.new_text)
            seq.token_ids += out.new_token_ids
            seq.logprobs += out.logprobs or []
            c.last = out
    kept = list(range(len(choices)))
    if len(choices) > prep.n:  # best_of: rank by the sequence's log-probability
        kept = sorted(kept, key=lambda i: -sequences[i].cumulative_logprob)[: prep.n]
    formatters = _formatters(prep, len(kept))
    out_choices = []
    for index, i in enumerate(kept):
        seq, formatter = sequences[i], formatters[index]
        logprobs = None
        if formatter:
            echoed = _echoed(prep, choices[i], formatter) if prep.echo_text is not None else None
            logprobs = _joined(echoed, formatter.format(seq.token_ids, seq.logprobs))
        text, reason = "".join(seq.text), choices[i].last.finish_reason
        if prep.endpoint == "chat":
            content, extra, reason = whole_message(text, prep.tools, prep.reasoning, reason)
            out_choices.append(oai.chat_choice(index, content, reason, logprobs, extra))
        else:
            out_choices.append(
                oai.completion_choice(index, (prep.echo_text or "") + text, reason, logprobs)
            )
    obj = "chat.completion" if prep.endpoint == "chat" else "text_completion"
    body = {"id": prep.request_id, "object": obj, "created": oai.now(), "model": model}
    body |= {"choices": out_choices, "usage": _usage(choices)}
    return body, [c.last for c in choices]
