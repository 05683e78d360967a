"""OpenAI's Responses API request (POST /v1/responses), validated, and its translation to
the chat request it runs as: `input` items and `instructions` become chat messages after the
stored conversation of `previous_response_id`; function tools, `tool_choice` and
`text.format` become the chat request's tools and response_format (serve_app/openai/tool_calls.py,
serve_app/openai/structured_fields.py). A mistake is an InvalidParam naming the Responses field."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from engine.core.errors import InvalidParam
from serve_app.openai import protocol as oai

# Chat fields a translated request's mistakes are reported under, and their Responses names.
_FIELD_NAMES = {
    "messages": "input",
    "response_format": "text.format",
    "max_completion_tokens": "max_output_tokens",
}
_MESSAGE_ROLES = ("user", "system", "developer", "assistant")
_TEXT_PARTS = ("input_text", "output_text", "text")


class ResponsesRequest(BaseModel):
    # Fields this server does not know are kept aside and ignored (or rejected) by name.
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    stream: bool = False
    store: bool = True
    background: bool = False
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = Field(None, max_length=16)
    user: str | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Accepted with no effect here: nothing they ask for is produced by this server.
    include: list[str] | None = None
    reasoning: dict[str, Any] | None = None
    service_tier: str | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    # Extensions as on the chat route (vLLM's): a seed, ignore_eos, priority.
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    ignore_eos: bool = False
    priority: int = Field(0, ge=-(2**31), lt=2**31)

    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})


def input_messages(body: ResponsesRequest) -> list[dict[str, Any]]:
    """`input` as chat messages (plain dicts, as the store keeps them)."""
    if isinstance(body.input, str):
        return [{"role": "user", "content": body.input}]
    if not body.input:
        raise InvalidParam("input", "input: must not be empty")
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(body.input):
        kind = item.get("type", "message")
        if kind == "message":
            messages.append(_message(i, item))
        elif kind == "function_call":
            call = _function_call(i, item)
            last = messages[-1] if messages else None
            if last and last["role"] == "assistant" and last.get("tool_calls") is not None:
                last["tool_calls"].append(call)  # parallel calls: one assistant turn
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            call_id, output = item.get("call_id"), item.get("output")
            if not isinstance(call_id, str) or not isinstance(output, str):
                raise InvalidParam(
                    f"input[{i}]", f"input[{i}]: a function_call_output has call_id and output"
                )
            messages.append({"role": "tool", "tool_call_id": call_id, "content": output})
        elif kind == "reasoning":
            continue  # a reasoning item handed back: chat templates drop past reasoning
        else:
            raise InvalidParam(
                f"input[{i}].type",
                f"input[{i}].type: {kind!r} is not supported (message, function_call, "
                "function_call_output, reasoning)",
            )
    return messages


def _message(i: int, item: dict[str, Any]) -> dict[str, Any]:
    role, content = item.get("role"), item.get("content")
    if role not in _MESSAGE_ROLES:
        raise InvalidParam(
            f"input[{i}].role", f"input[{i}].role: one of {', '.join(_MESSAGE_ROLES)}"
        )
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list):
        raise InvalidParam(f"input[{i}].content", f"input[{i}].content: a string or parts")
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise InvalidParam(
                f"input[{i}].content[{j}]",
                f"input[{i}].content[{j}]: only text parts are supported (input_text, "
                f"output_text), got {kind!r}",
            )
        texts.append(part["text"])
    return {"role": role, "content": "".join(texts)}


def _function_call(i: int, item: dict[str, Any]) -> dict[str, Any]:
    call_id, name, arguments = item.get("call_id"), item.get("name"), item.get("arguments")
    if not all(isinstance(v, str) for v in (call_id, name, arguments)):
        raise InvalidParam(
            f"input[{i}]", f"input[{i}]: a function_call has call_id, name and arguments"
        )
    return chat_tool_call(call_id, name, arguments)


def chat_tool_call(call_id: str, name: str, arguments: str) -> dict[str, Any]:
    """A function call as a chat assistant message carries it."""
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def chat_tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools in the chat request's shape; any other tool type is a 400."""
    if body.tools is None:
        return None
    tools = []
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function":
            raise InvalidParam(
                f"tools[{i}].type",
                f"tools[{i}].type: only function tools are served, got {tool.get('type')!r}",
            )
        function = {k: tool[k] for k in ("name", "description", "parameters") if k in tool}
        tools.append({"type": "function", "function": function})
    return tools


def chat_tool_choice(choice: str | dict[str, Any] | None) -> str | dict[str, Any] | None:
    if isinstance(choice, dict):
        if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
            raise InvalidParam(
                "tool_choice", "tool_choice: auto, none, required or a function by name"
            )
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict[str, Any] | None:
    """`text.format` as the chat request's response_format."""
    fmt = (text or {}).get("format")
    if fmt is not None and not isinstance(fmt, dict):
        raise InvalidParam("text.format", "text.format: an object with a `type`")
    if fmt is None or fmt.get("type") == "text":
        return None
    if fmt.get("type") == "json_object":
        return {"type": "json_object"}
    if fmt.get("type") != "json_schema":
        raise InvalidParam("text.format.type", "text.format.type: text, json_object or json_schema")
    if not isinstance(fmt.get("schema"), dict):
        raise InvalidParam("text.format.schema", "text.format.schema: a JSON schema object")
    schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
    return {"type": "json_schema", "json_schema": schema}


def chat_request(
    body: ResponsesRequest, history: list[dict[str, Any]], new: list[dict[str, Any]]
) -> oai.ChatCompletionRequest:
    """The chat request `body` runs as: instructions, then the stored conversation, then
    its own input messages `new`."""
    system = [{"role": "system", "content": body.instructions}] if body.instructions else []
    chat: dict[str, Any] = {
        "model": body.model,
        "messages": system + history + new,
        "max_completion_tokens": body.max_output_tokens,
        "tools": chat_tools(body),
        "tool_choice": chat_tool_choice(body.tool_choice),
        "parallel_tool_calls": body.parallel_tool_calls,
        "response_format": response_format(body.text),
        "seed": body.seed,
        "ignore_eos": body.ignore_eos,
        "priority": body.priority,
        "user": body.user,
    }
    chat |= {k: v for k in ("temperature", "top_p") if (v := getattr(body, k)) is not None}
    try:
        return oai.ChatCompletionRequest.model_validate(chat)
    except ValueError as exc:  # a part only the chat model checks
        raise InvalidParam("input", f"input: {exc}") from None


def renamed(exc: InvalidParam) -> InvalidParam:
    """A chat request's mistake under the Responses field it came from."""
    param = exc.param or ""
    head, dot, rest = param.partition(".")
    if head not in _FIELD_NAMES:
        return exc
    name = _FIELD_NAMES[head] + dot + rest
    message = str(exc).replace(f"{head}:", f"{name}:", 1)
    return InvalidParam(name, message)
