"""A client's mistakes over real HTTP: a 4xx in OpenAI's error body whose `param` names the
field, and the server keeps serving."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

from tests.local_serve import NARROW_AUTH

pytestmark = pytest.mark.timeout(300)


def _error(resp: httpx.Response) -> dict:
    body = resp.json()
    assert set(body) == {"error"}, body
    assert {"message", "type", "param", "code"} <= set(body["error"])
    return body["error"]


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"n": 0}, "n"),
        ({"logprobs": 21}, "logprobs"),
        ({"best_of": 0}, "best_of"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"priority": "urgent"}, "priority"),
        # Values that once reached the engine and came back as a 200 carrying an error.
        ({"seed": 2**70}, "seed"),
        ({"stop_token_ids": [10**9], "min_tokens": 1}, "stop_token_ids"),
        ({"logit_bias": {"999999": 5}}, "logit_bias"),
        ({"logit_bias": {"5": 500}}, "logit_bias"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "x"}}}},
            "response_format",
        ),
        ({"guided_regex": "("}, "guided_regex"),  # refused by the engine replica's compiler
        ({"guided_choice": ["a"], "structured_outputs": {"regex": "a"}}, "guided_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
    ],
)
def test_bad_completion_fields_answer_400(serve_cluster, patch, param):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 4} | patch
    resp = httpx.post(f"{serve_cluster.v1()}/completions", json=body)
    assert resp.status_code == 400, resp.text
    err = _error(resp)
    assert err["param"] == param, err
    assert err["type"] == "invalid_request_error"


def test_bad_chat_fields_answer_400(serve_cluster):
    url = f"{serve_cluster.v1()}/chat/completions"
    resp = httpx.post(url, json={"model": "tiny", "messages": []})
    assert resp.status_code == 400 and _error(resp)["param"] == "messages"
    resp = httpx.post(url, json={"model": "tiny", "messages": [{"role": "wizard", "content": "x"}]})
    assert resp.status_code == 400 and _error(resp)["param"].startswith("messages")


def test_prompt_too_long_names_both_numbers(serve_cluster):
    from transformers import AutoTokenizer

    prompt = "word " * 600
    tokenizer = AutoTokenizer.from_pretrained(serve_cluster.model)
    n_prompt = len(tokenizer.encode(prompt, add_special_tokens=True))
    resp = httpx.post(
        f"{serve_cluster.v1()}/completions",
        json={"model": "tiny", "prompt": prompt, "max_tokens": 10},
    )
    assert resp.status_code == 400
    err = _error(resp)
    assert "512" in err["message"] and str(n_prompt) in err["message"], err
    assert err["code"] == "context_length_exceeded"


def test_unknown_model_is_404(serve_cluster):
    client = openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)
    with pytest.raises(openai.NotFoundError) as info:
        client.completions.create(model="gpt-17", prompt="hi", max_tokens=2)
    assert info.value.body["param"] == "model"


def test_unknown_fields_are_a_400_where_the_app_rejects_them(serve_cluster):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "frobnicate": True}
    resp = httpx.post(f"{serve_cluster.v1('narrow')}/completions", json=body, headers=NARROW_AUTH)
    assert resp.status_code == 400
    assert _error(resp)["param"] == "frobnicate"


def test_api_keys_guard_v1_but_not_health(serve_cluster):
    """The narrow app asks for a key: none or a wrong one is a 401 in OpenAI's body (what
    the openai client raises as AuthenticationError); /health stays open."""
    base = f"{serve_cluster.base_url}/narrow"
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "narrow-key"}):
        resp = httpx.get(f"{base}/v1/models", headers=headers)
        assert resp.status_code == 401
        assert _error(resp)["code"] == "invalid_api_key"
    assert httpx.post(f"{base}/tokenize", json={"prompt": "x"}).status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        client.models.list()
    client = openai.OpenAI(base_url=f"{base}/v1", api_key="narrow-key", max_retries=0)
    assert client.models.list().data[0].id == "tiny"


@pytest.mark.parametrize(
    ("content", "headers"),
    [
        (b'{"model": "tiny", "prompt": "hi"', {}),  # cut short
        (b'{"model": "tiny", "prompt": "\xff\xfe"}', {}),
        (b'{"model": "tiny", "prompt": "caf\xe9"}', {}),  # latin-1, not UTF-8
        (b"[" * 100_000 + b"]" * 100_000, {}),  # nested past Python's recursion limit
        (b"not json at all", {"content-type": "application/json"}),
        (b'{"model": "tiny", "prompt": "hi"}', {"content-type": "text/plain"}),  # not JSON
        (b'{"model": "tiny", "prompt": "hi"}', {"content-type": None}),  # no content type
        (b"", {}),  # no body at all
    ],
    ids=[
        "truncated",
        "escaped-bad-bytes",
        "bad-utf8",
        "deep-nesting",
        "garbage",
        "text-plain",
        "no-content-type",
        "empty",
    ],
)
def test_unparsable_bodies_get_openais_error_body(serve_cluster, content, headers):
    url = f"{serve_cluster.v1()}/completions"
    sent = {"content-type": "application/json"} | headers
    resp = httpx.post(url, content=content, headers={k: v for k, v in sent.items() if v})
    assert 400 <= resp.status_code < 500, resp.text
    _error(resp)  # never FastAPI's {"detail": ...}
    assert (
        httpx.post(url, json={"model": "tiny", "prompt": "hi", "max_tokens": 1}).status_code == 200
    )


def test_oversized_bodies_and_unknown_routes_get_openais_error_body(serve_cluster):
    big = {"model": "tiny", "prompt": "x" * (5 << 20), "max_tokens": 1}
    resp = httpx.post(f"{serve_cluster.v1()}/completions", json=big)
    assert resp.status_code == 413
    assert _error(resp)["code"] == "request_too_large"
    # Chunked, with no Content-Length: counted as it arrives.
    encoded = json.dumps(big).encode()
    pieces = (encoded[i : i + (1 << 20)] for i in range(0, len(encoded), 1 << 20))
    resp = httpx.post(f"{serve_cluster.v1()}/completions", content=pieces)
    assert resp.status_code == 413
    assert _error(resp)["code"] == "request_too_large"
    small = json.dumps({"model": "tiny", "prompt": "chunked", "max_tokens": 2}).encode()
    resp = httpx.post(
        f"{serve_cluster.v1()}/completions",
        content=iter([small[:10], small[10:]]),
        headers={"content-type": "application/json"},
    )
    assert resp.status_code == 200, resp.text
    resp = httpx.get(f"{serve_cluster.v1()}/no-such-route")
    assert resp.status_code == 404
    _error(resp)
    resp = httpx.get(f"{serve_cluster.v1()}/completions")  # wrong method
    assert resp.status_code == 405
    _error(resp)


@pytest.mark.parametrize(
    "content_type", ["application/json; charset=utf-8", "Application/JSON", "application/x+json"]
)
def test_a_json_body_of_any_json_media_type_is_served(serve_cluster, content_type):
    """Bodies FastAPI would parse as JSON, the generation routes parse so too
    (serve_app/ingress/generation_routes.py), streamed or whole."""
    url = f"{serve_cluster.v1()}/completions"
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 3, "ignore_eos": True}
    headers = {"content-type": content_type}
    resp = httpx.post(url, content=json.dumps(body).encode(), headers=headers)
    assert resp.status_code == 200, resp.text
    assert resp.json()["usage"]["completion_tokens"] == 3
    streamed = json.dumps(body | {"stream": True}).encode()
    with httpx.stream("POST", url, content=streamed, headers=headers) as resp:
        lines = [line for line in resp.iter_lines() if line.startswith("data: ")]
    assert resp.status_code == 200
    assert lines[-1] == "data: [DONE]"
