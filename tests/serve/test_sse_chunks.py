"""The chunk templates say what the chunk dicts say (pure: no Serve)."""

from __future__ import annotations

import json

import pytest

from serve_app.openai import protocol as oai
from serve_app.openai.sse_chunks import ChunkEncoder

BASE = {"id": "cmpl-1", "object": "text_completion", "created": 7, "model": "tiny", "usage": None}
TEXTS = ["plain", "", 'quote " and \\ slash', "naïve ☃ \U0001f600", "line\nbreak\t"]


def _parsed(event: str) -> dict:
    assert event.startswith("data: ") and event.endswith("\n\n")
    return json.loads(event[len("data: ") : -2])


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("finish", [None, "length", "stop"])
def test_a_text_chunk_is_the_completion_choice(text, finish):
    encoder = ChunkEncoder(BASE)
    expected = BASE | {"choices": [oai.completion_choice(2, text, finish)]}
    assert _parsed(encoder.text(2, text, finish)) == expected
    assert list(_parsed(encoder.text(2, text, finish))) == list(expected)  # field order too


@pytest.mark.parametrize("text", TEXTS)
def test_a_content_chunk_is_the_chat_delta_choice(text):
    base = BASE | {"object": "chat.completion.chunk"}
    expected = base | {"choices": [oai.chat_delta_choice(0, {"content": text}, None)]}
    assert _parsed(ChunkEncoder(base).content(0, text)) == expected


def test_any_choice_goes_after_the_shared_fields():
    choice = oai.chat_delta_choice(1, {"role": "assistant", "content": ""}, None)
    assert _parsed(ChunkEncoder(BASE).event(choice)) == BASE | {"choices": [choice]}
