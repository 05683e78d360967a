"""What real clients send is served: the exact request bodies of the field's load tools and
SDK wrappers (vLLM's bench, GuideLLM, AIPerf, LangChain, LiteLLM; written from their public source),
each answered 200 in the shape that client parses; unknown fields ignored and named in a
header; the sampling fields they carry."""

from __future__ import annotations

import json

import httpx
import openai
import pytest

pytestmark = pytest.mark.timeout(300)

PROMPT = "The quick brown fox"
CHAT = [{"role": "user", "content": PROMPT}]

# vLLM's `vllm bench serve` (vllm/benchmarks/lib/endpoint_request_func.py), --backend openai
# with --ignore-eos, and --backend openai-chat.
VLLM_BENCH_COMPLETIONS = {
    "model": "tiny",
    "prompt": PROMPT,
    "repetition_penalty": 1.0,
    "max_tokens": 8,
    "logprobs": None,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}
VLLM_BENCH_CHAT = {
    "model": "tiny",
    "messages": [{"role": "user", "content": [{"type": "text", "text": PROMPT}]}],
    "max_completion_tokens": 8,
    "stream": True,
    "stream_options": {"include_usage": True},
    "ignore_eos": True,
}
# LiteLLM's hosted_vllm provider (litellm/llms/hosted_vllm/chat/transformation.py over
# OpenAIGPTConfig): the OpenAI SDK's body with the caller's parameters; Anthropic-style
# `thinking` arrives as `reasoning_effort` (not served: ignored and named).
LITELLM_CHAT = {
    "model": "tiny",
    "messages": CHAT,
    "temperature": 0.2,
    "max_tokens": 8,
    "reasoning_effort": "low",
}
LITELLM_CHAT_STREAM = {
    "model": "tiny",
    "messages": CHAT,
    "stream": True,
    "stream_options": {"include_usage": True},
    "max_tokens": 8,
    "n": 2,
    "ignore_eos": True,
}
# LangChain's ChatOpenAI (langchain_openai/chat_models/base.py `_default_params` + messages):
# model, stream, then the set parameters; stream_usage adds stream_options.
LANGCHAIN_CHAT = {
    "model": "tiny",
    "stream": False,
    "n": 1,
    "temperature": 0.7,
    "max_tokens": 8,
    "logit_bias": {},
    "messages": [{"content": PROMPT, "role": "user"}],
}
LANGCHAIN_CHAT_STREAM = LANGCHAIN_CHAT | {"stream": True, "stream_options": {"include_usage": True}}
# NVIDIA AIPerf's completions endpoint (a one-element prompt list, ignore_eos, usage).
AIPERF_COMPLETIONS = {
    "prompt": [PROMPT],
    "model": "tiny",
    "stream": True,
    "max_tokens": 8,
    "ignore_eos": True,
    "stream_options": {"include_usage": True},
}
# GuideLLM's openai_http backend (src/guidellm/backends/openai.py `_get_body`): both token
# limits, stop dropped (None), ignore_eos, streamed with usage.
GUIDELLM_COMPLETIONS = {
    "prompt": PROMPT,
    "model": "tiny",
    "max_tokens": 8,
    "max_completion_tokens": 8,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
GUIDELLM_CHAT = {
    "messages": [{"role": "user", "content": PROMPT}],
    "model": "tiny",
    "max_tokens": 8,
    "max_completion_tokens": 8,
    "ignore_eos": True,
    "stream": True,
    "stream_options": {"include_usage": True},
}
# Neutral values of everything a wrapper may forward, plus fields this server does not know.
NEUTRAL_EVERYTHING = {
    "model": "tiny",
    "messages": CHAT + [{"role": "assistant", "content": "ok", "refusal": None}],
    "max_tokens": 8,
    "n": 1,
    "logprobs": False,
    "top_logprobs": None,
    "presence_penalty": 0,
    "frequency_penalty": 0,
    "repetition_penalty": 1,
    "logit_bias": {},
    "response_format": {"type": "text"},
    "tool_choice": "none",
    "parallel_tool_calls": False,
    "user": "u-1",
    "store": False,
    "metadata": {"trace": "x"},
    "service_tier": "auto",
}


def _sse(resp: httpx.Response) -> list[dict]:
    lines = [ln[len("data: ") :] for ln in resp.text.splitlines() if ln.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(ln) for ln in lines[:-1]]


@pytest.mark.parametrize(
    ("path", "body", "ignored"),
    [
        ("completions", VLLM_BENCH_COMPLETIONS, ""),
        ("chat/completions", VLLM_BENCH_CHAT, ""),
        ("chat/completions", LANGCHAIN_CHAT, ""),
        ("chat/completions", LANGCHAIN_CHAT_STREAM, ""),
        ("completions", AIPERF_COMPLETIONS, ""),
        # A chat field on a completion: ignored (max_tokens already says the same).
        ("completions", GUIDELLM_COMPLETIONS, "max_completion_tokens"),
        ("chat/completions", GUIDELLM_CHAT, ""),
        ("chat/completions", LITELLM_CHAT, "reasoning_effort"),
        ("chat/completions", LITELLM_CHAT_STREAM, ""),
        (
            "chat/completions",
            NEUTRAL_EVERYTHING,
            "messages.refusal,metadata,service_tier,store",
        ),
    ],
    ids=[
        "vllm-bench",
        "vllm-bench-chat",
        "langchain",
        "langchain-stream",
        "aiperf",
        "guidellm",
        "guidellm-chat",
        "litellm",
        "litellm-stream-n2",
        "neutral",
    ],
)
def test_client_bodies_are_served_in_the_shape_they_parse(serve_cluster, path, body, ignored):
    resp = httpx.post(f"{serve_cluster.v1()}/{path}", json=body, timeout=60)
    assert resp.status_code == 200, resp.text
    chat = path.startswith("chat")
    if body.get("stream"):
        chunks = _sse(resp)
        texts = [
            (c["choices"][0]["delta"].get("content") if chat else c["choices"][0]["text"])
            for c in chunks
            if c["choices"]
        ]
        assert any(texts)
        usage = chunks[-1]["usage"]  # what vLLM's bench counts output tokens from
        if body.get("ignore_eos"):
            want = body.get("max_tokens", 8) * body.get("n", 1)
            assert usage["completion_tokens"] == want
    else:
        choice = resp.json()["choices"][0]
        assert choice["message"]["role"] == "assistant" and choice["message"]["content"]
    assert resp.headers.get("x-dynabatch-ignored-fields", "") == ignored


def test_degenerate_sampling_values_are_served(serve_cluster):
    """Once a 200 stream carrying a server error: now greedy, or the top token alone."""
    client = openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)
    greedy = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, temperature=0)
    for extra in ({"temperature": 1e-45}, {"top_p": 1e-45, "temperature": 1.0}):
        out = client.completions.create(model="tiny", prompt=PROMPT, max_tokens=6, **extra)
        assert out.choices[0].text == greedy.choices[0].text


def test_a_logit_bias_of_100_makes_greedy_emit_that_token(serve_cluster):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(serve_cluster.model)
    token = tokenizer.encode(" fox", add_special_tokens=False)[0]
    client = openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)
    out = client.completions.create(
        model="tiny", prompt=PROMPT, max_tokens=4, temperature=0, logit_bias={str(token): 100}
    )
    assert out.choices[0].text == tokenizer.decode([token] * 4)


def test_penalties_change_what_greedy_repeats(serve_cluster):
    """The tiny model loops under greedy decoding; a strong frequency penalty breaks the
    loop (every served token distinct over a short run), and the engine keeps serving."""
    client = openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)
    base = dict(model="tiny", prompt=PROMPT, max_tokens=24, temperature=0)
    plain = client.completions.create(**base, extra_body={"ignore_eos": True})
    penalized = client.completions.create(
        **base, frequency_penalty=2.0, extra_body={"ignore_eos": True, "repetition_penalty": 2.0}
    )
    assert penalized.choices[0].text != plain.choices[0].text
    assert penalized.usage.completion_tokens == 24


def test_tokenize_detokenize_and_the_model_card(serve_cluster):
    base = serve_cluster.base_url
    resp = httpx.post(f"{base}/tokenize", json={"model": "tiny", "prompt": PROMPT})
    assert resp.status_code == 200
    tokens = resp.json()["tokens"]
    assert resp.json()["count"] == len(tokens) and resp.json()["max_model_len"] == 512
    chat = httpx.post(f"{base}/tokenize", json={"model": "tiny", "messages": CHAT}).json()
    assert chat["count"] > len(tokens)  # the chat template's tokens
    back = httpx.post(f"{base}/detokenize", json={"model": "tiny", "tokens": tokens}).json()
    assert back["prompt"] == PROMPT
    bad = httpx.post(f"{base}/detokenize", json={"tokens": [10**9]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"
    client = openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)
    assert client.models.retrieve("tiny").id == "tiny"
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-17")
