"""A chat choice's message from its generated text: a reasoning model's leading
<think>...</think> as `reasoning_content`, the rest as `content` or, for requests with tools,
`tool_calls` (serve_app/openai/tool_calls.py); whole, or as the deltas of a stream."""

from __future__ import annotations

from typing import Any

from serve_app.openai.tool_calls import ToolCallStream, ToolPlan, parse_calls, tag_overlap

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str) -> tuple[str | None, str]:
    """(reasoning, the rest) of a whole output: reasoning only where it opens with <think>."""
    stripped = text.lstrip()
    if not stripped.startswith(THINK_OPEN):
        return None, text
    body = stripped[len(THINK_OPEN) :]
    reasoning, closed, rest = body.partition(THINK_CLOSE)
    return reasoning, rest.lstrip() if closed else ""


def whole_message(
    text: str, tools: ToolPlan | None, reasoning: bool, finish_reason: str | None
) -> tuple[str | None, dict[str, Any], str | None]:
    """(content, the message's other fields, finish_reason) of a whole chat choice."""
    extra: dict[str, Any] = {}
    if reasoning:
        thought, text = split_reasoning(text)
        if thought is not None:
            extra["reasoning_content"] = thought
    content: str | None = text
    if tools is not None:
        content, calls = parse_calls(tools, text)
        if calls:
            extra["tool_calls"] = calls
            if tools.mode != "named" and finish_reason == "stop":
                finish_reason = "tool_calls"
    return content, extra, finish_reason


class ChatDeltas:
    """One streamed chat choice: text in, OpenAI `delta` objects out."""

    def __init__(self, tools: ToolPlan | None, reasoning: bool) -> None:
        self.tools = ToolCallStream(tools) if tools is not None else None
        self.reasoning = reasoning
        self._text = ""
        self._thinking: bool | None = None if reasoning else False  # None: not known yet
        self._thought_sent = 0
        self._after_thought = False  # whitespace right after </think> is not content

    def feed(self, new_text: str, finished: bool) -> list[dict[str, Any]]:
        if self._thinking is False:
            return self._content(new_text, finished)
        self._text += new_text
        stripped = self._text.lstrip()
        if self._thinking is None:
            if THINK_OPEN.startswith(stripped) and not finished:
                return []  # may still open a thought
            self._thinking = stripped.startswith(THINK_OPEN)
            if not self._thinking:
                return self._content(self._text, finished)
        body = stripped[len(THINK_OPEN) :]
        thought, closed, rest = body.partition(THINK_CLOSE)
        if not closed and not finished:  # hold back what may be the start of </think>
            thought = thought[: len(thought) - tag_overlap(thought, THINK_CLOSE)]
        deltas = []
        if len(thought) > self._thought_sent:
            deltas.append({"reasoning_content": thought[self._thought_sent :]})
            self._thought_sent = len(thought)
        if closed:
            self._thinking, self._after_thought = False, True
            deltas += self._content(rest, finished)
        return deltas

    def finish_reason(self, reason: str | None) -> str | None:
        called = self.tools is not None and self.tools.called
        if called and self.tools.plan.mode != "named" and reason == "stop":
            return "tool_calls"
        return reason

    def _content(self, text: str, finished: bool) -> list[dict[str, Any]]:
        if self._after_thought:
            text = text.lstrip()
            self._after_thought = not text
        if self.tools is not None:
            return self.tools.feed(text, finished)
        return [{"content": text}] if text else []
