"""The Responses API's response object and its output items (reasoning, message,
function_call), whole or as the stream's events built from a chat choice's deltas
(serve_app/openai/chat_deltas.py); and the assistant turn a stored conversation keeps."""

from __future__ import annotations

import time
import uuid
from typing import Any

from serve_app.openai.responses.protocol import ResponsesRequest, chat_tool_call


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def usage(prompt: int, completion: int) -> dict[str, Any]:
    return {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": 0},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def outcome(finish_reason: str | None) -> tuple[str, dict[str, Any] | None]:
    """(status, incomplete_details) of a response whose generation ended so."""
    if finish_reason == "length":
        return "incomplete", {"reason": "max_output_tokens"}
    if finish_reason == "error":
        return "failed", None
    if finish_reason is None or finish_reason == "abort":
        return "cancelled", None
    return "completed", None


def response_object(
    response_id: str, body: ResponsesRequest, created_at: float, status: str
) -> dict[str, Any]:
    """The response as created (no output yet): what the request asked, echoed."""
    fmt = (body.text or {}).get("format") or {"type": "text"}
    return {
        "id": response_id,
        "object": "response",
        "created_at": created_at,
        "status": status,
        "background": body.background,
        "model": body.model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": body.instructions,
        "metadata": body.metadata or {},
        "max_output_tokens": body.max_output_tokens,
        "parallel_tool_calls": body.parallel_tool_calls is not False,
        "previous_response_id": body.previous_response_id,
        "store": body.store,
        "temperature": body.temperature if body.temperature is not None else 1.0,
        "top_p": body.top_p if body.top_p is not None else 1.0,
        "text": {"format": fmt},
        "tool_choice": body.tool_choice or "auto",
        "tools": body.tools or [],
        "truncation": body.truncation or "disabled",
        "user": body.user,
        "usage": None,
    }


def finished(
    response: dict[str, Any], output: list[dict], reason: str | None, counts: tuple[int, int]
) -> dict[str, Any]:
    """`response` ended: its output items, status, usage (prompt, completion tokens)."""
    status, incomplete = outcome(reason)
    done = response | {"status": status, "output": output, "incomplete_details": incomplete}
    done |= {"usage": usage(*counts), "completed_at": time.time()}
    if status == "failed":
        done["error"] = {"code": "server_error", "message": "the engine failed this response"}
    return done


def whole_output(content: str | None, extra: dict[str, Any]) -> list[dict[str, Any]]:
    """Output items of a whole chat message (serve_app/chat_deltas.whole_message)."""
    items = []
    if extra.get("reasoning_content") is not None:
        part = {"type": "reasoning_text", "text": extra["reasoning_content"]}
        items.append({"id": new_id("rs"), "type": "reasoning", "summary": [], "content": [part]})
    calls = extra.get("tool_calls") or []
    if content or not calls:
        items.append(_message(new_id("msg"), content or "", "completed"))
    for call in calls:
        function = call["function"]
        items.append(_call(new_id("fc"), call["id"], function["name"], function["arguments"]))
    return items


def assistant_turn(output: list[dict[str, Any]]) -> dict[str, Any]:
    """The chat message a stored conversation keeps for this output (reasoning left out, as
    chat templates drop past reasoning)."""
    text = "".join(
        part["text"] for item in output if item["type"] == "message" for part in item["content"]
    )
    calls = [
        chat_tool_call(i["call_id"], i["name"], i["arguments"])
        for i in output
        if i["type"] == "function_call"
    ]
    turn: dict[str, Any] = {"role": "assistant", "content": text or None}
    if calls:
        turn["tool_calls"] = calls
    return turn


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _message(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [_text_part(text)] if status == "completed" else []
    return {
        "id": item_id,
        "type": "message",
        "status": status,
        "role": "assistant",
        "content": content,
    }


def _call(
    item_id: str, call_id: str, name: str, arguments: str, status: str = "completed"
) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


class OutputEvents:
    """One response's output items, built from its chat deltas as they come: each call gives
    the stream's events (without sequence numbers) for what it added or closed."""

    def __init__(self) -> None:
        self.items: list[dict[str, Any]] = []  # those closed
        self._open: dict[str, Any] | None = None  # the item being streamed
        self._text = ""  # its text (message, reasoning) or arguments (function_call)

    def feed(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        if "reasoning_content" in delta:
            return self._grow("reasoning", delta["reasoning_content"])
        if "content" in delta:
            return self._grow("message", delta["content"] or "")
        events = []
        for call in delta.get("tool_calls") or []:
            if "id" in call:  # a new call
                events += self.close()
                self._open = _call(
                    new_id("fc"), call["id"], call["function"]["name"], "", "in_progress"
                )
                events.append(self._event("response.output_item.added", item=dict(self._open)))
            piece = call.get("function", {}).get("arguments") or ""
            if piece:
                self._text += piece
                events.append(self._event("response.function_call_arguments.delta", delta=piece))
        return events

    def close(self) -> list[dict[str, Any]]:
        """Close the open item (at the next item, or the end)."""
        item, text = self._open, self._text
        if item is None:
            return []
        self._open, self._text = None, ""
        kind = item["type"]
        if kind == "message":
            part = _text_part(text)
            events = [
                self._event(
                    "response.output_text.done", item, text=text, logprobs=[], content_index=0
                ),
                self._event("response.content_part.done", item, part=part, content_index=0),
            ]
            item |= {"status": "completed", "content": [part]}
        elif kind == "reasoning":
            events = [self._event("response.reasoning_text.done", item, text=text, content_index=0)]
            item |= {"content": [{"type": "reasoning_text", "text": text}]}
        else:
            events = [
                self._event(
                    "response.function_call_arguments.done", item, arguments=text, name=item["name"]
                )
            ]
            item |= {"status": "completed", "arguments": text}
        events.append(self._event("response.output_item.done", item, item=item))
        self.items.append(item)
        return events

    def _grow(self, kind: str, text: str) -> list[dict[str, Any]]:
        events = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            if kind == "message":
                self._open = _message(new_id("msg"), "", "in_progress")
            else:
                self._open = {"id": new_id("rs"), "type": "reasoning", "summary": [], "content": []}
            events.append(self._event("response.output_item.added", item=dict(self._open)))
            if kind == "message":
                part = _text_part("")
                events.append(
                    self._event("response.content_part.added", part=part, content_index=0)
                )
        if text:
            self._text += text
            name = (
                "response.output_text.delta"
                if kind == "message"
                else "response.reasoning_text.delta"
            )
            extra = {"logprobs": []} if kind == "message" else {}
            events.append(self._event(name, delta=text, content_index=0, **extra))
        return events

    def _event(self, kind: str, of: dict | None = None, **fields: Any) -> dict[str, Any]:
        """An event of item `of` (the open one by default)."""
        event = {"type": kind, "output_index": len(self.items)}
        if kind not in ("response.output_item.added", "response.output_item.done"):
            event["item_id"] = (of or self._open)["id"]
        return event | fields
