"""The Responses stream's events from a chat choice's deltas (serve_app/openai/responses/output.py),
without a server: reasoning, text and function calls each open an item, stream it and close
it when the next begins, in output order; a whole message gives the same items."""

from __future__ import annotations

from serve_app.openai.responses.output import OutputEvents, assistant_turn, whole_output


def _run(deltas: list[dict]) -> tuple[list[dict], list[dict]]:
    items = OutputEvents()
    events = [e for d in deltas for e in items.feed(d)] + items.close()
    return events, items.items


def test_reasoning_then_text_then_two_calls_stream_as_four_items():
    call = {"index": 0, "id": "call_1", "type": "function"}
    deltas = [
        {"reasoning_content": "Let me"},
        {"reasoning_content": " think."},
        {"content": "Sure"},
        {"content": "."},
        {"tool_calls": [call | {"function": {"name": "add", "arguments": ""}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": '{"a": 1'}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": ', "b": 2}'}}]},
        {
            "tool_calls": [
                {"index": 1, "id": "call_2", "function": {"name": "neg", "arguments": "{}"}}
            ]
        },
    ]
    events, items = _run(deltas)
    assert [e["type"] for e in events] == [
        "response.output_item.added",
        "response.reasoning_text.delta",
        "response.reasoning_text.delta",
        "response.reasoning_text.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
    ]
    assert [e["output_index"] for e in events] == [0] * 5 + [1] * 7 + [2] * 5 + [3] * 4
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call", "function_call"]
    assert items[0]["content"][0]["text"] == "Let me think."
    assert items[1]["content"][0]["text"] == "Sure." and items[1]["status"] == "completed"
    assert (items[2]["call_id"], items[2]["arguments"]) == ("call_1", '{"a": 1, "b": 2}')
    assert (items[3]["name"], items[3]["arguments"]) == ("neg", "{}")
    ids = {e["item_id"] for e in events if "item_id" in e}
    assert ids == {i["id"] for i in items}
    turn = assistant_turn(items)
    assert turn["content"] == "Sure." and [c["id"] for c in turn["tool_calls"]] == [
        "call_1",
        "call_2",
    ]


def test_a_whole_message_gives_the_same_items():
    calls = [{"id": "call_1", "type": "function", "function": {"name": "add", "arguments": "{}"}}]
    items = whole_output("Sure.", {"reasoning_content": "Hm.", "tool_calls": calls})
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    only_calls = whole_output(None, {"tool_calls": calls})
    assert [i["type"] for i in only_calls] == ["function_call"]
    assert whole_output("", {})[0]["content"][0]["text"] == ""
