"""POST /v1/responses at an ingress replica: the request runs as a chat request
(serve_app/openai/responses/protocol.py) through the path every request takes
(serve_app/openai/request_path.py: validation, engine client, metrics, tracing), and its output
comes back as a response object, as the Responses stream's events, or later (`background`);
stored responses live in the ResponseStore (serve_app/openai/responses/store.py) so any ingress
replica continues them."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, replace
from functools import partial
from typing import Any

from fastapi.responses import JSONResponse, Response

from engine.core.errors import InvalidParam
from serve_app.openai.chat_deltas import ChatDeltas, whole_message
from serve_app.openai.completion_bodies import Choice, merged
from serve_app.openai.errors import OpenAIError
from serve_app.openai.event_stream import EventStream
from serve_app.openai.request_path import RequestPath
from serve_app.openai.responses.output import (
    OutputEvents,
    assistant_turn,
    finished,
    new_id,
    response_object,
    whole_output,
)
from serve_app.openai.responses.protocol import (
    ResponsesRequest,
    chat_request,
    input_messages,
    renamed,
)
from serve_app.transport.streaming import Prepared, runs_response

ENDPOINT, ENDPOINT_PATH = "responses", "/v1/responses"
# How often a background response asks the store whether a cancel came (through any replica).
CANCEL_POLL_S = 0.5


@dataclass
class Turn:
    """One response being made: its request, the chat request it runs as, the stored
    conversation before it and its own input (chat messages), the response object so far."""

    body: ResponsesRequest
    prep: Prepared
    history: list[dict[str, Any]]
    new: list[dict[str, Any]]
    response: dict[str, Any]


class ResponsesService:
    def __init__(self, path: RequestPath, store) -> None:
        """`store`: the app's ResponseStore table (None: nothing is stored)."""
        self.path = path
        self.store = store
        self._background: dict[str, asyncio.Task] = {}

    # ------------------------------------------------------------------------ routes
    async def create(self, body: ResponsesRequest) -> Response:
        path = self.path
        with contextlib.ExitStack() as scope:
            span = scope.enter_context(path.span(ENDPOINT_PATH, body.model, body.stream))
            headers, prep = {}, None
            try:
                headers = path.ignored_header(body)
                turn = await self._prepare(body)
                prep = turn.prep
                if body.background:
                    return self._start_background(turn, headers)
                choices = await path.client.start_choices(prep, 1, span.carrier(), body.priority)
            except OpenAIError as exc:
                path.metrics.answered(ENDPOINT, exc.status)
                if prep is not None and exc.status in (429, 503):
                    path.record_rejected(prep)
                return exc.response()
            record = partial(path.record, prep, span, time.perf_counter() - prep.started)
            if body.stream:
                path.metrics.answered(ENDPOINT, 200)
                runs_response()
                events = self._events(turn, choices, record)
                return EventStream(events, scope.pop_all(), headers)
            try:
                done = await self._whole(turn, choices, record)
                if done["status"] == "failed":
                    raise OpenAIError.server_error(500, "engine error: the response failed")
            except OpenAIError as exc:  # lost with its replica, and no other took it; failed
                path.metrics.answered(ENDPOINT, exc.status)
                return exc.response()
            path.metrics.answered(ENDPOINT, 200)
            return JSONResponse(done, headers=headers)

    async def get(self, response_id: str) -> Response:
        record = await self._record(response_id)
        return JSONResponse(record["response"])

    async def input_items(self, response_id: str) -> Response:
        record = await self._record(response_id)
        items = [_as_item(m) for m in record["input"]]
        first, last = (items[0]["id"], items[-1]["id"]) if items else (None, None)
        body = {"object": "list", "data": items, "first_id": first, "last_id": last}
        return JSONResponse(body | {"has_more": False})

    async def delete(self, response_id: str) -> Response:
        if self.store is None or not await self.store.delete.remote(response_id):
            return _not_found(response_id).response()
        return JSONResponse({"id": response_id, "object": "response", "deleted": True})

    async def cancel(self, response_id: str) -> Response:
        record = await self._record(response_id)
        if not record["response"].get("background"):
            message = "Only responses created with background=true can be cancelled"
            return OpenAIError(400, message, param="response_id").response()
        record = await self.store.cancel.remote(response_id)
        status = record["response"]["status"]
        if status != "cancelled":
            message = f"Cannot cancel a response that is {status}"
            return OpenAIError(400, message, param="response_id").response()
        task = self._background.get(response_id)
        if task is not None:
            task.cancel()
        return JSONResponse(record["response"])

    # ------------------------------------------------------------------------ the path
    async def _prepare(self, body: ResponsesRequest) -> Turn:
        """The turn: its chat request's Prepared (its id a response id), the conversation
        so far and this request's input."""
        history: list[dict[str, Any]] = []
        if body.previous_response_id is not None:
            previous = None
            if self.store is not None:
                previous = await self.store.get.remote(body.previous_response_id)
            if previous is None:
                raise OpenAIError(
                    400,
                    f"Previous response with id '{body.previous_response_id}' not found.",
                    param="previous_response_id",
                    code="previous_response_not_found",
                )
            history = previous["conversation"]
        if body.background and (body.stream or not body.store or self.store is None):
            field = "stream" if body.stream else "store"
            message = f"{field}: background responses are stored and not streamed here"
            raise OpenAIError(400, message, param=field)
        path = self.path
        try:
            new = input_messages(body)
            chat = chat_request(body, history, new)
            prep = path.prepare("chat", chat, await path.adapters.resolve(body.model))
        except InvalidParam as exc:
            raise OpenAIError.bad_request(renamed(exc)) from None
        except OpenAIError as exc:
            if exc.param is not None:
                named = renamed(InvalidParam(exc.param, exc.message))
                exc.param, exc.message = named.param, str(named)
            raise
        prep = replace(prep, request_id=new_id("resp"))
        response = response_object(prep.request_id, body, time.time(), "in_progress")
        return Turn(body, prep, history, new, response)

    async def _whole(self, turn: Turn, choices: list[Choice], record) -> dict:
        choice = choices[0]
        text = []
        async with contextlib.aclosing(merged(choices)) as outs:
            async for _, out in outs:
                text.append(out.new_text)
                choice.last = out
        last = choice.last
        record([last])
        prep = turn.prep
        content, extra, _ = whole_message("".join(text), prep.tools, prep.reasoning, None)
        output = whole_output(content, extra)
        done = finished(turn.response, output, last.finish_reason, _counts(last))
        await self._store(turn, done)
        return done

    async def _events(self, turn: Turn, choices: list[Choice], record) -> AsyncIterator[str]:
        """The Responses stream: created, in_progress, each item's events, then completed
        (incomplete, failed); an engine failure is a response.failed event, not a cut."""
        sequence = 0

        def sse(event: dict[str, Any]) -> str:
            nonlocal sequence
            event["sequence_number"], sequence = sequence, sequence + 1
            return f"event: {event['type']}\ndata: {json.dumps(event)}\n\n"

        yield sse({"type": "response.created", "response": turn.response})
        yield sse({"type": "response.in_progress", "response": turn.response})
        choice, items = choices[0], OutputEvents()
        deltas = ChatDeltas(turn.prep.tools, turn.prep.reasoning)
        try:
            async with contextlib.aclosing(merged(choices)) as outs:
                async for _, out in outs:
                    choice.last = out
                    if out.finish_reason == "error":
                        break
                    for delta in deltas.feed(out.new_text, out.finished):
                        for event in items.feed(delta):
                            yield sse(event)
        except OpenAIError:  # lost with its replica, and no other took it
            choice.last = replace(choice.last, finish_reason="error")
        for event in items.close():
            yield sse(event)
        record([choice.last])
        last = choice.last
        done = finished(turn.response, items.items, last.finish_reason, _counts(last))
        await self._store(turn, done)
        kind = {"completed": "completed", "incomplete": "incomplete"}.get(done["status"], "failed")
        yield sse({"type": f"response.{kind}", "response": done})

    def _start_background(self, turn: Turn, headers: dict[str, str]) -> Response:
        prep, queued = turn.prep, turn.response | {"status": "queued"}

        async def run() -> None:
            await self._store(turn, queued)
            watcher = asyncio.current_task()
            poll = asyncio.create_task(self._watch_cancel(prep.request_id, watcher))
            try:
                choices = await self.path.client.start_choices(prep, 1, None, turn.body.priority)
                await self._store(turn, turn.response)
                await self._whole(turn, choices, lambda _: None)
            except asyncio.CancelledError:
                pass  # the store says cancelled (ResponseStore.cancel)
            except OpenAIError as exc:
                error = {"code": exc.code or exc.err_type, "message": exc.message}
                await self._store(turn, turn.response | {"status": "failed", "error": error})
            finally:
                poll.cancel()
                self._background.pop(prep.request_id, None)

        self._background[prep.request_id] = asyncio.get_running_loop().create_task(run())
        return JSONResponse(queued, headers=headers)

    async def _watch_cancel(self, response_id: str, task: asyncio.Task) -> None:
        while True:
            await asyncio.sleep(CANCEL_POLL_S)
            with contextlib.suppress(Exception):  # a store restarting: ask again
                if await self.store.cancelled.remote(response_id):
                    task.cancel()
                    return

    async def _store(self, turn: Turn, response: dict[str, Any]) -> None:
        """Keep `response` (as it stands) and the conversation it ends, where asked."""
        if not turn.body.store or self.store is None:
            return
        conversation = turn.history + turn.new
        if response["status"] in ("completed", "incomplete"):
            conversation = conversation + [assistant_turn(response["output"])]
        record = {"response": response, "conversation": conversation, "input": turn.new}
        await self.store.put.remote(response["id"], record)

    async def _record(self, response_id: str) -> dict[str, Any]:
        record = None if self.store is None else await self.store.get.remote(response_id)
        if record is None:
            raise _not_found(response_id)
        return record


def _counts(last) -> tuple[int, int]:
    return last.num_prompt_tokens, last.num_output_tokens


def _not_found(response_id: str) -> OpenAIError:
    message = f"Response with id '{response_id}' not found."
    return OpenAIError(404, message, param="response_id", code="not_found")


def _as_item(message: dict[str, Any]) -> dict[str, Any]:
    """A stored chat message as a Responses input item."""
    if message["role"] == "tool":
        item = {"type": "function_call_output", "call_id": message["tool_call_id"]}
        return item | {"id": new_id("fco"), "output": message["content"]}
    part = "output_text" if message["role"] == "assistant" else "input_text"
    content = [{"type": part, "text": message.get("content") or ""}]
    return {"id": new_id("msg"), "type": "message", "role": message["role"], "content": content}
