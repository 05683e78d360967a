"""The tool-call and reasoning readers on model-written text (no server): Hermes/Qwen
<tool_call> blocks and Llama-3 JSON calls, whole and streamed in any split, and a reasoning
model's <think> block; what is not a call stays content."""

from __future__ import annotations

import json

import pytest

from serve_app.openai.chat_deltas import ChatDeltas, whole_message
from serve_app.openai.tool_calls import ToolPlan, calls_so_far, parse_calls

HERMES = ToolPlan("auto", ("get_weather", "add"))
LLAMA3 = ToolPlan("auto", ("get_weather", "add"), parser="llama3_json")
TEXT = (
    'Let me check.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Zürich"}}\n'
    '</tool_call>\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)


def _stream(plan: ToolPlan | None, text: str, step: int, reasoning: bool = False):
    deltas = ChatDeltas(plan, reasoning)
    out = []
    for i in range(0, len(text), step):
        out += deltas.feed(text[i : i + step], i + step >= len(text))
    content = "".join(d.get("content", "") for d in out)
    thought = "".join(d.get("reasoning_content", "") for d in out)
    calls: dict[int, list[str]] = {}  # index -> [name, arguments]: as clients put them together
    for c in (c for d in out for c in d.get("tool_calls", [])):
        name_and_args = calls.setdefault(c["index"], ["", ""])
        name_and_args[0] = c["function"].get("name") or name_and_args[0]
        name_and_args[1] += c["function"].get("arguments", "")
    calls = [tuple(calls[i]) for i in sorted(calls)]
    return content, thought, calls, deltas.finish_reason("stop")


def test_hermes_blocks_become_calls_and_the_rest_content():
    content, calls = parse_calls(HERMES, TEXT)
    assert content == "Let me check."
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Zürich"}),
        ("add", {"a": 1, "b": 2}),
    ]


@pytest.mark.parametrize("step", [1, 3, 7, 1000])
def test_streamed_hermes_calls_equal_the_whole_ones(step):
    content, _, calls, reason = _stream(HERMES, TEXT, step)
    whole_content, extra, whole_reason = whole_message(TEXT, HERMES, False, "stop")
    assert content.strip() == whole_content and reason == whole_reason == "tool_calls"
    whole_calls = [(c["function"]["name"], c["function"]["arguments"]) for c in extra["tool_calls"]]
    assert calls == whole_calls


def test_hermes_arguments_stream_as_they_are_written():
    deltas = ChatDeltas(HERMES, False)
    pieces = [d for i in range(0, len(TEXT), 4) for d in deltas.feed(TEXT[i : i + 4], False)]
    pieces += deltas.feed("", True)
    arguments = [
        c["function"]["arguments"]
        for d in pieces
        for c in d.get("tool_calls", [])
        if c["index"] == 0 and "id" not in c
    ]
    assert len(arguments) > 3 and "".join(arguments) == '{"city": "Zürich"}'


@pytest.mark.parametrize(
    "text",
    [
        "Just text, <tool_call almost.",
        '<tool_call>{"name": "undeclared", "arguments": {}}</tool_call>',
        "<tool_call>{broken json</tool_call>",
    ],
)
def test_what_is_not_a_call_stays_content(text):
    assert parse_calls(HERMES, text) == (text, [])
    content, _, calls, reason = _stream(HERMES, text, 2)
    assert (content, calls, reason) == (text, [], "stop")


def test_llama3_json_calls():
    content, calls = parse_calls(
        LLAMA3, '<|python_tag|>{"name": "add", "parameters": {"a": 4, "b": 5}}'
    )
    assert content is None and json.loads(calls[0]["function"]["arguments"]) == {"a": 4, "b": 5}
    assert parse_calls(LLAMA3, "The answer is 9.") == ("The answer is 9.", [])


def test_required_output_is_read_as_it_grows():
    text = '[{"name": "add", "arguments": {"a": 1, "b": 2}}, {"name": "get_weather", "argu'
    assert calls_so_far(text) == [("add", '{"a": 1, "b": 2}', True)]
    text = '[{"name": "get_weather", "arguments": {"city": "a\\"}b"'
    assert calls_so_far(text) == [("get_weather", '{"city": "a\\"}b"', False)]


@pytest.mark.parametrize("step", [1, 4, 1000])
def test_a_thought_becomes_reasoning_content(step):
    text = "<think>First, 2 + 2.\nIt is 4.</think>\n\nThe answer is 4."
    content, thought, _, _ = _stream(None, text, step, reasoning=True)
    assert (thought, content) == ("First, 2 + 2.\nIt is 4.", "The answer is 4.")
    whole, extra, _ = whole_message(text, None, True, "stop")
    assert (extra["reasoning_content"], whole) == (thought, content)
    assert _stream(None, "No thought here.", step, reasoning=True)[:2] == ("No thought here.", "")
