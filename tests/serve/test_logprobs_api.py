"""logprobs over HTTP with the real openai client: completions' legacy shape and chat's, whole
and streamed, equal to transformers' log_softmax of the same model (the oracle)."""

from __future__ import annotations

import openai
import pytest
import torch

from tests.engine.oracle import HFOracle

pytestmark = pytest.mark.timeout(300)

PROMPT_IDS = [1203, 77, 2981, 400, 15, 3003]


@pytest.fixture(scope="module")
def oracle(serve_cluster) -> HFOracle:
    return HFOracle(serve_cluster.model)


@pytest.fixture(scope="module")
def client(serve_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)


def _want(oracle: HFOracle, prompt: list[int], n: int) -> tuple[list[int], list[torch.Tensor]]:
    tokens = oracle.greedy(prompt, n)
    rows = []
    for j in range(n):
        with torch.no_grad():
            logits = oracle.model(torch.tensor([prompt + tokens[:j]])).logits[0, -1]
        rows.append(logits.float().log_softmax(-1))
    return tokens, rows


@pytest.mark.parametrize("stream", [False, True])
def test_completion_logprobs_equal_the_oracle(client, oracle, serve_cluster, stream):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(serve_cluster.model)
    n, k = 5, 3
    tokens, rows = _want(oracle, PROMPT_IDS, n)
    kwargs = dict(model="tiny", prompt=PROMPT_IDS, max_tokens=n, temperature=0, logprobs=k)
    kwargs["extra_body"] = {"ignore_eos": True}
    if stream:
        merged = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for chunk in client.completions.create(**kwargs, stream=True):
            lp = chunk.choices[0].logprobs if chunk.choices else None
            for key in merged:
                merged[key] += getattr(lp, key) if lp else []
        logprobs = merged
    else:
        lp = client.completions.create(**kwargs).choices[0].logprobs
        logprobs = {
            key: getattr(lp, key)
            for key in ("tokens", "token_logprobs", "top_logprobs", "text_offset")
        }
    assert logprobs["tokens"] == [tokenizer.decode([t]) for t in tokens]
    for j, token in enumerate(tokens):
        assert abs(logprobs["token_logprobs"][j] - float(rows[j][token])) < 1e-4
        top = torch.topk(rows[j], k)
        want = {
            tokenizer.decode([t]): float(v) for t, v in zip(top.indices, top.values, strict=True)
        }
        got = logprobs["top_logprobs"][j]
        assert set(got) == set(want)  # greedy: the sampled token is the top one
        assert all(abs(got[p] - want[p]) < 1e-4 for p in want)
    pieces = logprobs["tokens"]
    assert logprobs["text_offset"] == [sum(len(p) for p in pieces[:j]) for j in range(n)]


@pytest.mark.parametrize("stream", [False, True])
def test_chat_logprobs_have_openais_shape(client, stream):
    kwargs = dict(
        model="tiny",
        messages=[{"role": "user", "content": "Hello there"}],
        max_tokens=4,
        temperature=0,
        logprobs=True,
        top_logprobs=2,
        extra_body={"ignore_eos": True},
    )
    if stream:
        content = []
        for chunk in client.chat.completions.create(**kwargs, stream=True):
            if chunk.choices and chunk.choices[0].logprobs:
                content += chunk.choices[0].logprobs.content
    else:
        content = client.chat.completions.create(**kwargs).choices[0].logprobs.content
    assert len(content) == 4
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 2
        assert entry.top_logprobs[0].token == entry.token  # greedy
        assert entry.top_logprobs[0].logprob >= entry.top_logprobs[1].logprob
        assert bytes(entry.bytes).decode(errors="replace") == entry.token
    plain = client.chat.completions.create(
        **{k: v for k, v in kwargs.items() if "logprobs" not in k}
    )
    assert plain.choices[0].logprobs is None
