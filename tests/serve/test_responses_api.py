"""OpenAI's Responses API over HTTP with the real openai client: a response's text equals
the chat route's for the same conversation (greedy); the stream's events come in order,
complete, and add up to the whole response; a JSON schema holds through its grammar
(function tools: tests/serve/test_tool_calls_api.py); previous_response_id continues a
stored conversation; GET, input items, delete; background responses run and cancel; bad
bodies are 400s naming the field."""

from __future__ import annotations

import json
import time

import httpx
import openai
import pytest

from tests.local_serve import assert_serves_and_frees

pytestmark = pytest.mark.timeout(300)

GREEDY = {"model": "tiny", "temperature": 0, "max_output_tokens": 12}


@pytest.fixture(scope="module")
def client(serve_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)


def _chat_text(client: openai.OpenAI, messages: list[dict]) -> str:
    chat = client.chat.completions.create(
        model="tiny", messages=messages, temperature=0, max_completion_tokens=12
    )
    return chat.choices[0].message.content or ""


def test_a_response_says_what_the_chat_route_says(client):
    response = client.responses.create(input="Tell me a story.", instructions="Be brief.", **GREEDY)
    assert response.object == "response" and response.id.startswith("resp_")
    assert response.status == "incomplete"  # 12 tokens of random weights: cut by the limit
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.usage.output_tokens == 12
    assert response.usage.total_tokens == response.usage.input_tokens + 12
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Tell me a story."},
    ]
    assert response.output_text == _chat_text(client, messages)
    # Message items as input: the same conversation.
    items = [{"type": "message", "role": "user", "content": [{"type": "input_text", "text": "Hi"}]}]
    again = client.responses.create(input=items, **GREEDY)
    assert again.output_text == _chat_text(client, [{"role": "user", "content": "Hi"}])


def test_the_stream_brings_every_event_in_order_and_the_whole_response(client):
    whole = client.responses.create(input="Stream this.", **GREEDY)
    events = list(client.responses.create(input="Stream this.", stream=True, **GREEDY))
    kinds = [e.type for e in events]
    deltas = [e.delta for e in events if e.type == "response.output_text.delta"]
    assert len(deltas) > 1
    expected = ["response.created", "response.in_progress", "response.output_item.added"]
    expected += ["response.content_part.added"] + ["response.output_text.delta"] * len(deltas)
    expected += ["response.output_text.done", "response.content_part.done"]
    expected += ["response.output_item.done", "response.incomplete"]
    assert kinds == expected
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(deltas)
    assert text == whole.output_text
    assert events[-4].text == text and events[-3].part.text == text
    item_id = events[2].item.id
    assert all(e.item_id == item_id for e in events[3:-2])
    last = events[-1].response
    assert last.output_text == text and last.output[0].id == item_id
    assert last.usage.output_tokens == 12


def test_a_json_schema_format_gives_a_valid_document(client):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    text = {"format": {"type": "json_schema", "name": "verdict", "schema": schema}}
    response = client.responses.create(
        model="tiny", input="Is it fine?", text=text, max_output_tokens=40, temperature=0
    )
    assert response.status == "completed"
    assert isinstance(json.loads(response.output_text)["ok"], bool)


def test_previous_response_id_continues_the_stored_conversation(client):
    first = client.responses.create(input="My name is Ada.", **GREEDY)
    second = client.responses.create(
        input="What is my name?", previous_response_id=first.id, **GREEDY
    )
    assert second.previous_response_id == first.id
    messages = [
        {"role": "user", "content": "My name is Ada."},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "What is my name?"},
    ]
    assert second.output_text == _chat_text(client, messages)
    assert client.responses.retrieve(first.id).output_text == first.output_text
    items = client.responses.input_items.list(second.id)
    assert [i.content[0].text for i in items.data] == ["What is my name?"]
    client.responses.delete(first.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(first.id)
    unstored = client.responses.create(input="Forget me.", store=False, **GREEDY)
    with pytest.raises(openai.BadRequestError) as info:
        client.responses.create(input="Again", previous_response_id=unstored.id, **GREEDY)
    assert info.value.body["param"] == "previous_response_id"


def test_a_background_response_runs_and_another_cancels(serve_cluster, client):
    started = client.responses.create(input="Later.", background=True, **GREEDY)
    assert started.status == "queued"
    deadline = time.monotonic() + 60
    while (done := client.responses.retrieve(started.id)).status in ("queued", "in_progress"):
        assert time.monotonic() < deadline
        time.sleep(0.2)
    assert done.status == "incomplete" and len(done.output_text) > 0
    long = client.responses.create(
        model="tiny",
        input="Go on.",
        background=True,
        max_output_tokens=400,
        extra_body={"ignore_eos": True},
    )
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    time.sleep(1.0)
    assert client.responses.retrieve(long.id).status == "cancelled"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(done.id)  # not running: nothing to cancel
    assert_serves_and_frees(serve_cluster)


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"input": [{"type": "web_search_call"}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image"}]}]},
            "input[0].content[0]",
        ),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input[0].role"),
        ({"input": []}, "input"),
        ({"tools": [{"type": "web_search"}]}, "tools[0].type"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"text": {"format": {"type": "yaml"}}}, "text.format.type"),
        ({"text": {"format": "json"}}, "text.format"),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format.schema"),
        ({"max_output_tokens": 0}, "max_output_tokens"),
        ({"max_output_tokens": 4000}, "input"),
        ({"temperature": 3}, "temperature"),
        ({"previous_response_id": "resp_unknown"}, "previous_response_id"),
        ({"background": True, "stream": True}, "stream"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(serve_cluster, patch, param):
    body = {"model": "tiny", "input": "hi"} | patch
    resp = httpx.post(f"{serve_cluster.v1()}/responses", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_unknown_responses_are_404s(serve_cluster):
    for method, path in [("GET", ""), ("DELETE", ""), ("POST", "/cancel"), ("GET", "/input_items")]:
        url = f"{serve_cluster.v1()}/responses/resp_nothing{path}"
        resp = httpx.request(method, url, timeout=30)
        assert resp.status_code == 404, (method, path, resp.text)
        assert resp.json()["error"]["code"] == "not_found"
