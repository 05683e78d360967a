"""Structured outputs over HTTP with the real openai client: `response_format` (json_schema,
json_object), the SDK's `parse()` with a pydantic model, vLLM's `structured_outputs` and
`guided_*` fields, whole and streamed. The tiny model's weights are random: only the grammar
makes these outputs valid."""

from __future__ import annotations

import json
import re
from typing import Literal

import openai
import pydantic
import pytest

pytestmark = pytest.mark.timeout(300)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=10)
    kind: Literal["cat", "dog", "fish"]
    age: int = pydantic.Field(ge=0, le=30)
    vaccinated: bool
    toys: list[Literal["ball", "rope"]] = pydantic.Field(max_length=2)


@pytest.fixture(scope="module")
def client(serve_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)


def test_the_sdks_parse_with_a_pydantic_model(client):
    for seed in range(3):
        completion = client.chat.completions.parse(
            model="tiny",
            messages=[{"role": "user", "content": f"Describe pet number {seed}."}],
            response_format=Pet,
            max_completion_tokens=300,
            seed=seed,
        )
        message = completion.choices[0].message
        assert isinstance(message.parsed, Pet), message.content
        assert completion.choices[0].finish_reason == "stop"


def test_a_streamed_json_schema_concatenates_to_a_valid_document(client):
    schema = Pet.model_json_schema()
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "A pet, streamed."}],
        response_format={"type": "json_schema", "json_schema": {"name": "pet", "schema": schema}},
        max_tokens=300,
        temperature=0,
        stream=True,
    )
    chunks = [c.choices[0].delta.content or "" for c in stream if c.choices]
    assert len([c for c in chunks if c]) > 3  # it did stream
    Pet.model_validate_json("".join(chunks))


def test_vllms_fields_on_completions(client):
    pick = client.completions.create(
        model="tiny",
        prompt="Pick one:",
        max_tokens=20,
        temperature=1.0,
        extra_body={"guided_choice": ["alpha", "beta", "gamma"]},
    )
    assert pick.choices[0].text in {"alpha", "beta", "gamma"}
    code = client.completions.create(
        model="tiny",
        prompt="Code:",
        max_tokens=20,
        extra_body={"structured_outputs": {"regex": r"[A-Z]{2}-\d{3}"}},
    )
    assert re.fullmatch(r"[A-Z]{2}-\d{3}", code.choices[0].text)
    doc = client.completions.create(
        model="tiny",
        prompt="JSON:",
        max_tokens=200,
        extra_body={"guided_json": {"type": "array", "items": {"type": "boolean"}, "maxItems": 4}},
    )
    assert all(isinstance(b, bool) for b in json.loads(doc.choices[0].text))


def test_json_object_is_an_object(serve_cluster, client):
    from transformers import AutoTokenizer

    close = AutoTokenizer.from_pretrained(serve_cluster.model).convert_tokens_to_ids("}")
    out = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Any JSON object."}],
        max_tokens=300,
        response_format={"type": "json_object"},
        logit_bias={str(close): 4},  # random weights would nest without end
        n=2,
        seed=1,
    )
    for choice in out.choices:
        assert isinstance(json.loads(choice.message.content), dict)
