"""Tool calling over HTTP with the real openai client. With random weights only the grammar
makes calls: `tool_choice` required and named must return calls to declared functions whose
arguments validate, the same streamed as whole; histories with calls and results are served;
the Responses API's function tools likewise."""

from __future__ import annotations

import json
from collections.abc import Iterator

import jsonschema
import openai
import pytest

from tests.local_serve import app_args

pytestmark = pytest.mark.timeout(300)

WEATHER = {
    "type": "object",
    "properties": {
        "city": {"type": "string", "maxLength": 12},
        "unit": {"enum": ["celsius", "fahrenheit"]},
    },
    "required": ["city", "unit"],
    "additionalProperties": False,
}
ADD = {
    "type": "object",
    "properties": {
        "a": {"type": "integer", "minimum": -100, "maximum": 100},
        "b": {"type": "integer", "minimum": -100, "maximum": 100},
    },
    "required": ["a", "b"],
    "additionalProperties": False,
}
SCHEMAS = {"get_weather": WEATHER, "add": ADD}
TOOLS = [
    {"type": "function", "function": {"name": name, "description": name, "parameters": schema}}
    for name, schema in SCHEMAS.items()
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris, and what is 2 + 3?"}]


APP = "tools"


@pytest.fixture(scope="module")
def tools_app(serve_cluster) -> Iterator[str]:
    """Its own app: the tiny tokenizer spends ~500 tokens on these tools' JSON, more than the
    shared apps' 512-token context."""
    from ray import serve

    from serve_app import build_app

    args = app_args(
        serve_cluster.model,
        engine={"max_model_len": 2048, "kv_cache_bytes": 16 << 20},
        engine_replicas={"num_replicas": 1, "num_cpus": 0.25},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield APP
    serve.delete(APP)


@pytest.fixture(scope="module")
def client(serve_cluster, tools_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused", max_retries=0)


def _calls(message) -> list[tuple[str, str]]:
    return [(c.function.name, c.function.arguments) for c in message.tool_calls or []]


def _streamed(client, **kwargs) -> tuple[list[tuple[str, str]], str]:
    calls: dict[int, list[str]] = {}
    reason = None
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            for delta in choice.delta.tool_calls or []:
                name_and_args = calls.setdefault(delta.index, ["", ""])
                if delta.function.name:
                    name_and_args[0] = delta.function.name
                name_and_args[1] += delta.function.arguments or ""
            reason = choice.finish_reason or reason
    return [tuple(calls[i]) for i in sorted(calls)], reason


@pytest.mark.parametrize("parallel", [True, False])
def test_required_returns_valid_calls_whole_and_streamed_alike(client, parallel):
    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=parallel,
        max_tokens=400,
        temperature=0,
    )
    whole = client.chat.completions.create(**kwargs)
    choice = whole.choices[0]
    calls = _calls(choice.message)
    assert choice.finish_reason == "tool_calls" and calls, choice
    assert len(calls) == 1 or parallel
    for name, arguments in calls:
        jsonschema.validate(json.loads(arguments), SCHEMAS[name])
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    assert _streamed(client, **kwargs) == (calls, "tool_calls")


def test_a_named_function_is_called(client):
    kwargs = dict(
        model="tiny",
        messages=MESSAGES,
        tools=TOOLS,
        tool_choice={"type": "function", "function": {"name": "add"}},
        max_tokens=200,
        temperature=1.0,
        seed=5,
    )
    whole = client.chat.completions.create(**kwargs)
    calls = _calls(whole.choices[0].message)
    assert [name for name, _ in calls] == ["add"]
    jsonschema.validate(json.loads(calls[0][1]), ADD)
    assert whole.choices[0].message.content is None
    assert _streamed(client, **kwargs) == (calls, "stop")


def test_a_history_of_calls_and_results_is_served(client):
    history = MESSAGES + [
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "5"},
    ]
    out = client.chat.completions.create(
        model="tiny", messages=history, tools=TOOLS, max_tokens=8, temperature=0
    )
    assert out.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert out.usage.prompt_tokens > 100  # the tools and the call are in the prompt


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {}}]}, "tools"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_tool_fields_answer_400(serve_cluster, tools_app, patch, param):
    import httpx

    body = {"model": "tiny", "messages": MESSAGES, "tools": TOOLS, "max_tokens": 4} | patch
    resp = httpx.post(f"{serve_cluster.v1(APP)}/chat/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


RESPONSES_TOOL = {"type": "function", "name": "add", "description": "add", "parameters": ADD}


def test_the_responses_api_calls_a_function_tool_whole_and_streamed(client):
    kwargs = {
        "model": "tiny",
        "input": "What is 2 + 3?",
        "tools": [RESPONSES_TOOL],
        "max_output_tokens": 80,
    }
    kwargs |= {"tool_choice": {"type": "function", "name": "add"}, "temperature": 0}
    response = client.responses.create(**kwargs)
    (call,) = [item for item in response.output if item.type == "function_call"]
    assert call.name == "add" and call.call_id and call.status == "completed"
    assert set(json.loads(call.arguments)) == {"a", "b"}
    events = list(client.responses.create(stream=True, **kwargs))
    kinds = [e.type for e in events]
    assert kinds[2] == "response.output_item.added" and events[2].item.type == "function_call"
    pieces = [e.delta for e in events if e.type == "response.function_call_arguments.delta"]
    (done,) = [e for e in events if e.type == "response.function_call_arguments.done"]
    assert "".join(pieces) == done.arguments == call.arguments
    assert kinds[-2:] == ["response.output_item.done", "response.completed"]
    # The call's result handed back continues the conversation.
    result = {"type": "function_call_output", "call_id": call.call_id, "output": "5"}
    back = client.responses.create(
        model="tiny",
        input=[{"role": "user", "content": "What is 2 + 3?"}, call.model_dump(), result],
        temperature=0,
        max_output_tokens=4,
    )
    assert back.status == "incomplete" and back.output[0].type == "message"
