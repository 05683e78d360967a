"""n, best_of and echo over HTTP with the real openai client: indexed choices, summed usage,
reproducible seeded sequences, the prompt's KV blocks shared at one engine replica, and
best_of's pick equal to the most likely of the sequences it drew."""

from __future__ import annotations

import random

import httpx
import openai
import pytest
import torch
from transformers import AutoTokenizer

from tests.engine.oracle import HFOracle

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(serve_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def tokenizer(serve_cluster):
    return AutoTokenizer.from_pretrained(serve_cluster.model)


def _fresh_prompt(length: int, seed: int) -> list[int]:
    """Token ids no other test sends: nothing of it is in any prefix cache yet."""
    rng = random.Random(seed)
    return [rng.randrange(300, 4000) for _ in range(length)]


def _prefix_hits(serve_cluster) -> int:
    stats = serve_cluster.replica_stats("llm", 2)
    return sum(s["prefix_cache_hits"] for s in stats.values())


def test_greedy_n_gives_indexed_oracle_choices_sharing_the_prompt_blocks(
    serve_cluster, client, tokenizer
):
    prompt = _fresh_prompt(40, seed=1)  # two full 16-token blocks and 8 tokens more
    want = tokenizer.decode(HFOracle(serve_cluster.model).greedy(prompt, 6))
    before = _prefix_hits(serve_cluster)
    resp = client.completions.create(
        model="tiny",
        prompt=prompt,
        max_tokens=6,
        temperature=0,
        n=4,
        extra_body={"ignore_eos": True},
    )
    assert [c.index for c in resp.choices] == [0, 1, 2, 3]
    assert [c.text for c in resp.choices] == [want] * 4
    assert resp.usage.prompt_tokens == 40 and resp.usage.completion_tokens == 24
    # The three later sequences found the first one's two full blocks at its replica.
    assert _prefix_hits(serve_cluster) - before >= 3 * 32


def test_seeded_n_is_reproducible_and_each_choice_is_its_own_seed(client):
    kwargs = dict(model="tiny", prompt="Once upon", max_tokens=8, temperature=1.0, seed=7)
    kwargs["extra_body"] = {"ignore_eos": True}
    texts = [c.text for c in client.completions.create(**kwargs, n=3).choices]
    assert len(set(texts)) == 3  # different sequences
    assert [c.text for c in client.completions.create(**kwargs, n=3).choices] == texts
    # Choice i is the sequence a request with seed 7 + i draws alone.
    alone = client.completions.create(**(kwargs | {"seed": 9})).choices[0].text
    assert alone == texts[2]


def test_streamed_chat_n_indexes_every_chunk_and_sums_usage(client):
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Tell me"}],
        max_tokens=5,
        n=2,
        seed=3,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )
    text = {0: "", 1: ""}
    finished, usage = set(), None
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            text[choice.index] += choice.delta.content or ""
            if choice.finish_reason:
                finished.add(choice.index)
    assert finished == {0, 1}
    assert text[0] and text[1] and text[0] != text[1]
    assert usage is not None and usage.completion_tokens == 10


def test_best_of_returns_the_most_likely_of_its_sequences(client):
    kwargs = dict(model="tiny", prompt="The river", max_tokens=6, temperature=1.0)
    kwargs["extra_body"] = {"ignore_eos": True}
    best = client.completions.create(**kwargs, seed=11, n=1, best_of=3)
    assert len(best.choices) == 1 and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == 18  # every sequence drawn is billed
    drawn = []
    for i in range(3):
        choice = client.completions.create(**kwargs, seed=11 + i, logprobs=0).choices[0]
        drawn.append((sum(choice.logprobs.token_logprobs), choice.text))
    assert best.choices[0].text == max(drawn)[1]


def test_echo_puts_the_prompt_before_the_completion(client):
    kwargs = dict(model="tiny", prompt="Echo this", max_tokens=4, temperature=0, echo=True)
    plain = client.completions.create(**(kwargs | {"echo": False})).choices[0].text
    assert client.completions.create(**kwargs).choices[0].text == "Echo this" + plain
    streamed = "".join(
        c.choices[0].text for c in client.completions.create(**kwargs, stream=True) if c.choices
    )
    assert streamed == "Echo this" + plain


@pytest.mark.parametrize(
    ("patch", "param"),
    [
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"best_of": 2, "stream": True}, "best_of"),
        ({"n": 129}, "n"),
        ({"n": 0}, "n"),
    ],
)
def test_bad_sequence_counts_answer_400(serve_cluster, patch, param):
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2} | patch
    resp = httpx.post(f"{serve_cluster.v1()}/completions", json=body)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param


def test_more_sequences_than_a_replica_holds_answer_400(serve_cluster):
    # The narrow app's replica holds 4 requests (max_num_seqs 2 + max_queued_requests 2).
    body = {"model": "tiny", "prompt": "hi", "max_tokens": 2, "n": 5}
    resp = httpx.post(
        f"{serve_cluster.v1('narrow')}/completions",
        json=body,
        headers={"Authorization": "Bearer narrow-key"},
    )
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == "n"


@pytest.mark.parametrize("stream", [False, True])
def test_echo_with_logprobs_scores_the_prompt_as_the_oracle(serve_cluster, client, stream):
    prompt = [1203, 77, 2981, 400, 15, 3003]
    with torch.no_grad():
        model = HFOracle(serve_cluster.model).model
        rows = model(torch.tensor([prompt])).logits[0].float().log_softmax(-1)
    kwargs = dict(model="tiny", prompt=prompt, max_tokens=2, temperature=0, echo=True)
    if stream:
        token_logprobs = []
        for chunk in client.completions.create(**kwargs, logprobs=1, stream=True):
            lp = chunk.choices[0].logprobs if chunk.choices else None
            token_logprobs += lp.token_logprobs if lp else []
    else:
        lp = client.completions.create(**kwargs, logprobs=1).choices[0].logprobs
        token_logprobs = lp.token_logprobs
    assert len(token_logprobs) == len(prompt) + 2
    assert token_logprobs[0] is None  # nothing predicts the first prompt token
    for pos in range(1, len(prompt)):
        assert abs(token_logprobs[pos] - float(rows[pos - 1][prompt[pos]])) < 1e-4
