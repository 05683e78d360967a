"""A client's mistakes over real HTTP: a 4xx in OpenAI's error body whose `param` names the
field, and the server keeps serving."""

from __future__ import annotations

import httpx
import openai
import pytest

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
        ({"n": 2}, "n"),
        ({"logprobs": 2}, "logprobs"),
        ({"frobnicate": True}, "frobnicate"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [999999]}, "prompt"),
        ({"stop": [""]}, "stop"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"priority": "urgent"}, "priority"),
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
