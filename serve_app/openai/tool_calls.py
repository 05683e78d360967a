"""Tool calling: what `tools` and `tool_choice` ask of the output, and the tool calls read
back out of it, whole or as streamed deltas.

`tool_choice` "required" and a named function are held by a grammar (the engine's structured
outputs): a named call's output is its arguments object; "required" outputs a JSON array of
`{"name": ..., "arguments": {...}}` (one call when `parallel_tool_calls` is false). With
"auto" the model writes calls in its own format, read by a per-model parser: Hermes/Qwen
`<tool_call>{...}</tool_call>` blocks, or Llama-3's JSON `{"name": ..., "parameters": ...}`.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any, Literal

from engine.core.errors import InvalidParam
from engine.core.sampling_params import SamplingParams, StructuredOutput

Mode = Literal["named", "required", "auto"]
HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


@dataclass(frozen=True)
class ToolPlan:
    """How a chat request's output becomes tool calls."""

    mode: Mode
    names: tuple[str, ...]
    parser: str = "hermes"  # auto: hermes | llama3_json
    named: str | None = None  # the function a named tool_choice calls

    def grammar(self, parameters: dict[str, dict], parallel: bool) -> StructuredOutput | None:
        if self.mode == "named":
            schema = parameters[self.named]
            return StructuredOutput("json", json.dumps(schema), param="tool_choice")
        if self.mode == "auto":
            return None
        calls = [
            {
                "type": "object",
                "properties": {"name": {"const": name}, "arguments": parameters[name]},
                "required": ["name", "arguments"],
                "additionalProperties": False,
            }
            for name in self.names
        ]
        schema: dict[str, Any] = {"type": "array", "items": {"anyOf": calls}, "minItems": 1}
        if not parallel:
            schema["maxItems"] = 1
        return StructuredOutput("json", json.dumps(schema), param="tool_choice")


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parser: str
) -> tuple[ToolPlan, dict[str, dict]] | None:
    """The plan for a request's `tools` and `tool_choice` (None: no tool calls), and each
    function's parameters schema. Raises InvalidParam naming the bad field."""
    if not tools and tool_choice not in (None, "none", "auto"):
        raise InvalidParam("tool_choice", "tool_choice: a function to call needs `tools`")
    if not tools or tool_choice == "none":
        return None
    parameters: dict[str, dict] = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        name = function.get("name") if isinstance(function, dict) else None
        if tool.get("type") != "function" or not isinstance(name, str) or not name:
            raise InvalidParam("tools", f"tools[{i}]: a function tool with a `name`")
        if name in parameters:
            raise InvalidParam("tools", f"tools[{i}]: function {name!r} is declared twice")
        schema = function.get("parameters") or {"type": "object", "properties": {}}
        if not isinstance(schema, dict):
            raise InvalidParam("tools", f"tools[{i}]: `parameters` must be a JSON schema object")
        parameters[name] = schema
    names = tuple(parameters)
    if tool_choice in (None, "auto"):
        return ToolPlan("auto", names, parser), parameters
    if tool_choice == "required":
        return ToolPlan("required", names, parser), parameters
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if name not in parameters:
        raise InvalidParam(
            "tool_choice",
            "tool_choice: none, auto, required or {'type': 'function', 'function': {'name': N}} "
            "with N a declared tool",
        )
    return ToolPlan("named", names, parser, named=name), parameters


def hold_to_tools(
    params: SamplingParams, plan: ToolPlan, parameters: dict[str, dict], parallel: bool
) -> None:
    """The grammar of a required or named tool choice, on the request's sampling."""
    grammar = plan.grammar(parameters, parallel)
    if grammar is None:
        return
    if params.structured is not None:
        raise InvalidParam(
            "tool_choice",
            "tool_choice: required or a named function cannot go with another "
            "structured output (response_format)",
        )
    params.structured = grammar


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def call(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    return {
        "id": call_id or new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool calls) of a whole output."""
    if plan.mode == "named":
        return None, [call(plan.named, text)]
    if plan.mode == "required":  # the arguments as generated, as they were streamed
        calls = [call(name, args) for name, args, whole in calls_so_far(text) if whole]
        return (None, calls) if calls else (text, [])
    if plan.parser == "llama3_json":
        return _llama3_calls(plan, text)
    blocks = HERMES_CALL.findall(text)
    calls = [_hermes_call(block, plan.names) for block in blocks]
    if not calls or None in calls:
        return text, []  # no call, or a malformed one: the text stays content
    content = text[: text.find("<tool_call>")].strip()  # as vLLM: the text before the calls
    return content or None, calls


def _hermes_call(block: str, names: tuple[str, ...]) -> dict[str, Any] | None:
    """One block's call: its arguments as written where the block reads `{"name": ...,
    "arguments": ...}` (as they were streamed), else re-serialised from any key order."""
    found = calls_so_far(block)
    if found and found[0][2] and found[0][0] in names:
        name, arguments, _ = found[0]
        try:
            json.loads(arguments)
            return call(name, arguments)
        except json.JSONDecodeError:
            return None
    return _call_object(block, names)


def _llama3_calls(plan: ToolPlan, text: str) -> tuple[str | None, list[dict[str, Any]]]:
    body = text.strip().removeprefix("<|python_tag|>").strip()
    calls = []
    for part in body.split(";") if body.startswith("{") else []:
        item = _call_object(part, plan.names, arguments_key="parameters")
        if item is None:
            return text, []
        calls.append(item)
    return (None, calls) if calls else (text, [])


def _call_object(
    text: str, names: tuple[str, ...], arguments_key: str = "arguments"
) -> dict[str, Any] | None:
    try:
        item = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(item, dict) or item.get("name") not in names:
        return None
    arguments = item.get(arguments_key, item.get("arguments", {}))
    return call(item["name"], json.dumps(arguments, ensure_ascii=False))


@dataclass
class ToolCallStream:
    """One choice's streamed tool calls: each delta of text in, OpenAI's `delta`s out. Calls
    stream their id and name, then their arguments as they are generated (auto: Hermes blocks
    written name first; other calls whole once the output ends); auto streams the content
    before the first call, holding back what may start a tag."""

    plan: ToolPlan
    text: str = ""
    sent: list[tuple[str, int]] = field(default_factory=list)  # per call: id, argument chars
    content_sent: int = 0

    def feed(self, new_text: str, finished: bool) -> list[dict[str, Any]]:
        self.text += new_text
        if self.plan.mode == "named":
            return self._arguments([(self.plan.named, self.text, True)])
        if self.plan.mode == "required":
            return self._arguments(calls_so_far(self.text))
        return self._auto(finished)

    def _arguments(self, calls: list[tuple[str, str, bool]]) -> list[dict[str, Any]]:
        deltas = []
        for index, (name, arguments, _) in enumerate(calls):
            if index == len(self.sent):
                call_id = new_call_id()
                self.sent.append((call_id, 0))
                head = {"index": index, "id": call_id, "type": "function"}
                deltas.append(head | {"function": {"name": name, "arguments": ""}})
            call_id, done = self.sent[index]
            if len(arguments) > done:
                piece = {"index": index, "function": {"arguments": arguments[done:]}}
                deltas.append(piece)
                self.sent[index] = (call_id, len(arguments))
        return [{"tool_calls": [d]} for d in deltas]

    def _auto(self, finished: bool) -> list[dict[str, Any]]:
        hermes = self.plan.parser == "hermes"
        start = self.text.find("<tool_call>") if hermes else -1
        if not hermes and self.text.lstrip().startswith(("{", "<|python")):
            start = 0
        visible = self.text if start < 0 else self.text[:start]
        if start < 0 and not finished:  # hold back what may be the start of a tag
            visible = visible[: len(visible) - tag_overlap(visible, "<tool_call>")]
        deltas = []
        if len(visible) > self.content_sent:
            deltas.append({"content": visible[self.content_sent :]})
            self.content_sent = len(visible)
        if start < 0:
            return deltas
        if hermes:  # calls written as {"name": ..., "arguments": ...} stream their arguments
            blocks = [b.split("</tool_call>")[0] for b in self.text[start:].split("<tool_call>")]
            growing = [found[0] for b in blocks if (found := calls_so_far(b))]
            growing = [c for c in growing if c[0] in self.plan.names]
            deltas += self._arguments(growing)
        if finished:
            _, calls = parse_calls(self.plan, self.text)
            for index, c in enumerate(calls[len(self.sent) :], start=len(self.sent)):
                deltas.append({"tool_calls": [{"index": index, **c}]})  # each one whole
                self.sent.append((c["id"], len(c["function"]["arguments"])))
            if not calls and len(self.text) > self.content_sent and not self.sent:
                deltas.append({"content": self.text[self.content_sent :]})  # no call after all
        return deltas

    @property
    def called(self) -> bool:
        return bool(self.sent)


def tag_overlap(text: str, tag: str) -> int:
    """Length of the longest end of `text` that begins `tag` (to hold back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


_CALL_HEAD = re.compile(r'\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')


def calls_so_far(text: str) -> list[tuple[str, str, bool]]:
    """The calls written as `{"name": ..., "arguments": ...}` in `text` so far (a required
    output, a Hermes block): (name, the arguments text so far, whether they are whole)."""
    calls = []
    position = 0
    while match := _CALL_HEAD.search(text, position):
        end = _value_end(text, match.end())
        arguments = text[match.end() : len(text) if end is None else end]
        calls.append((json.loads(f'"{match.group(1)}"'), arguments, end is not None))
        if end is None:
            break
        position = end
    return calls


def _value_end(text: str, start: int) -> int | None:
    """Index just past the JSON object starting at `start`, or None while it is open."""
    depth, in_string, escaped = 0, False, False
    for i in range(start, len(text)):
        ch = text[i]
        if in_string:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_string = False
            continue
        if ch == '"':
            in_string = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
            if depth == 0:
                return i + 1
    return None
