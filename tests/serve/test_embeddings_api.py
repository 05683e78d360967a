"""/v1/embeddings over HTTP with the real openai client: vectors equal transformers' final
hidden states pooled as the checkpoint says (the tiny model publishes nothing: last token,
normalized) within 1e-5, whatever else is in the batch (inputs of one request, generation
beside them); strings and token ids; float and base64; bad bodies are 400s naming the
field; afterwards the engine replicas hold no request and no block."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModel, AutoTokenizer

from engine.model.pooling_config import EmbeddingConfig
from serve_app.openai.embeddings import encoded
from tests.local_serve import NARROW_AUTH, assert_serves_and_frees

pytestmark = pytest.mark.timeout(300)

TEXTS = ["Hello world", "The quick brown fox jumps over the lazy dog", "a"]


@pytest.fixture(scope="module")
def client(serve_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)


@pytest.fixture(scope="module")
def oracle(serve_cluster):
    tokenizer = AutoTokenizer.from_pretrained(serve_cluster.model)
    model = AutoModel.from_pretrained(serve_cluster.model, dtype=torch.float32).eval()

    def embed(text_or_ids: str | list[int]) -> torch.Tensor:
        ids = text_or_ids
        if isinstance(text_or_ids, str):
            ids = tokenizer.encode(text_or_ids, add_special_tokens=True)
        with torch.no_grad():
            hidden = model(torch.tensor([ids])).last_hidden_state[0]
        return F.normalize(hidden[-1], dim=0)

    return embed


def _close(vector: list[float], want: torch.Tensor) -> bool:
    return torch.allclose(torch.tensor(vector), want, atol=1e-5, rtol=0)


def test_embeddings_equal_transformers_hidden_states_pooled(client, oracle):
    one = client.embeddings.create(model="tiny", input=TEXTS[0], encoding_format="float")
    assert one.object == "list" and one.model == "tiny" and len(one.data) == 1
    assert _close(one.data[0].embedding, oracle(TEXTS[0]))
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0
    # The SDK's default asks for base64 and decodes it: the same vectors.
    many = client.embeddings.create(model="tiny", input=TEXTS)
    assert [d.index for d in many.data] == [0, 1, 2]
    for text, item in zip(TEXTS, many.data, strict=True):
        assert _close(item.embedding, oracle(text)), text
    ids = [[5, 17, 99, 3], list(range(10, 60))]
    by_ids = client.embeddings.create(model="tiny", input=ids, encoding_format="float")
    for prompt, item in zip(ids, by_ids.data, strict=True):
        assert _close(item.embedding, oracle(prompt))
    single = client.embeddings.create(model="tiny", input=ids[0], encoding_format="float")
    assert _close(single.data[0].embedding, oracle(ids[0]))


def _story(i: int) -> dict:
    """A greedy chat request generating beside the embeddings."""
    messages = [{"role": "user", "content": f"Story {i}"}]
    return {"model": "tiny", "messages": messages, "max_tokens": 40, "temperature": 0}


def test_embeddings_beside_generation_are_unchanged_and_leave_nothing(
    serve_cluster, client, oracle
):
    async def run() -> tuple[list, list[str]]:
        aclient = openai.AsyncOpenAI(base_url=serve_cluster.v1(), api_key="u", max_retries=0)
        chats = [aclient.chat.completions.create(**_story(i)) for i in range(4)]
        embeds = [aclient.embeddings.create(model="tiny", input=TEXTS) for _ in range(4)]
        done = await asyncio.gather(*chats, *embeds)
        return done[4:], [c.choices[0].message.content for c in done[:4]]

    embeddings, texts = asyncio.run(run())
    for answer in embeddings:
        for text, item in zip(TEXTS, answer.data, strict=True):
            assert _close(item.embedding, oracle(text))
    alone = [
        client.chat.completions.create(**_story(i)).choices[0].message.content for i in range(4)
    ]
    assert texts == alone
    assert_serves_and_frees(serve_cluster)


@pytest.mark.parametrize(
    "patch, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": ["ok", ""]}, "input[1]"),
        ({"input": [1, 10**9]}, "input"),
        ({"input": "word " * 2000}, "input"),
        ({"dimensions": 0}, "dimensions"),
        ({"dimensions": 8}, "dimensions"),  # the tiny model publishes no Matryoshka sizes
        ({"encoding_format": "hex"}, "encoding_format"),
        ({"input": {"text": "hi"}}, "input"),
    ],
)
def test_bad_bodies_are_400s_naming_the_field(serve_cluster, patch, param):
    body = {"model": "tiny", "input": "hi"} | patch
    resp = httpx.post(f"{serve_cluster.v1()}/embeddings", json=body, timeout=30)
    assert resp.status_code == 400, resp.text
    assert resp.json()["error"]["param"] == param, resp.text


def test_more_inputs_than_a_replica_holds_are_served(serve_cluster, oracle):
    """The narrow app's one engine replica holds 4 requests: 12 inputs go 4 at a time."""
    texts = [f"text number {i}" for i in range(12)]
    body = {"model": "tiny", "input": texts, "encoding_format": "float"}
    url = f"{serve_cluster.v1('narrow')}/embeddings"
    resp = httpx.post(url, json=body, headers=NARROW_AUTH, timeout=120)
    assert resp.status_code == 200, resp.text
    vectors = [item["embedding"] for item in resp.json()["data"]]
    assert all(_close(v, oracle(t)) for v, t in zip(vectors, texts, strict=True))


def test_dimensions_truncate_and_renormalize_where_the_model_allows():
    config = EmbeddingConfig("last", True, hidden_size=4, matryoshka=(2, 4))
    config.check_dimensions(2)
    with pytest.raises(ValueError, match="dimensions"):
        config.check_dimensions(3)
    assert encoded([0.6, 0.0, 0.8, 0.0], 2, True, "float") == [1.0, 0.0]
    assert encoded([3.0, 4.0, 1.0], 2, False, "float") == [3.0, 4.0]
    packed = encoded([0.5, -1.0], None, True, "base64")
    assert packed == "AAAAPwAAgL8="  # little-endian float32, as OpenAI's
