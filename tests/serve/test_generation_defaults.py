"""engine.generation_config: a request that leaves a sampling field out samples with the
checkpoint's generation_config.json value (auto, vLLM's default); one that sets it keeps its
own; `none` ignores the file."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from engine.core.errors import InvalidParam
from engine.model.generation_defaults import generation_defaults
from serve_app.config import AppArgs
from serve_app.openai import protocol as oai
from serve_app.openai.prompts import PromptBuilder
from serve_app.openai.request_path import RequestPath

MODEL_DEFAULTS = {"temperature": 0.0, "top_k": 20, "top_p": 0.95, "max_new_tokens": 7}


@pytest.fixture
def model_with_defaults(tiny_model: str, tmp_path: Path) -> str:
    model = tmp_path / "tiny-with-defaults"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps(config | MODEL_DEFAULTS))
    return str(model)


def _path(model: str, mode: str = "auto") -> RequestPath:
    args = AppArgs(model=model, engine={"generation_config": mode, "max_model_len": 64})
    return RequestPath(args, 64, PromptBuilder(model), None, None, None, None)


def test_the_checkpoint_sets_the_defaults_a_request_leaves_out(model_with_defaults: str):
    path = _path(model_with_defaults)
    assert path.defaults == {"temperature": 0.0, "top_k": 20, "top_p": 0.95, "max_tokens": 7}
    left_out = oai.CompletionRequest(model="m", prompt="Hello")
    params = path.prepare("completions", left_out, None).params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0, 20, 0.95, 7)

    chosen = oai.CompletionRequest(
        model="m", prompt="Hello", temperature=0.8, top_k=0, top_p=1.0, max_tokens=3
    )
    params = path.prepare("completions", chosen, None).params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (0.8, 0, 1.0, 3)

    chat = oai.ChatCompletionRequest(model="m", messages=[{"role": "user", "content": "Hi"}])
    params = path.prepare("chat", chat, None).params
    assert (params.temperature, params.max_tokens) == (0.0, 7)


def test_a_default_max_tokens_stays_within_the_context(model_with_defaults: str):
    path = _path(model_with_defaults)
    path.defaults["max_tokens"] = 10_000
    body = oai.CompletionRequest(model="m", prompt="Hello")
    prep = path.prepare("completions", body, None)
    assert prep.params.max_tokens == 64 - len(prep.prompt_token_ids)


def test_none_keeps_the_apis_own_defaults(model_with_defaults: str):
    path = _path(model_with_defaults, "none")
    assert path.defaults == {}
    params = path.prepare("completions", oai.CompletionRequest(model="m", prompt="Hi"), None).params
    assert (params.temperature, params.top_k, params.top_p, params.max_tokens) == (1.0, 0, 1.0, 16)


def test_a_value_no_request_could_send_fails_the_start(model_with_defaults: str):
    file = Path(model_with_defaults) / "generation_config.json"
    file.write_text(json.dumps({"top_p": 0.0}))
    with pytest.raises(InvalidParam, match="top_p") as err:
        generation_defaults(model_with_defaults, "auto")
    assert err.value.param == "engine.generation_config"
    literal = "engine.generation_config\n  Input should be .auto. or .none."
    with pytest.raises(ValueError, match=literal):
        AppArgs(model=model_with_defaults, engine={"generation_config": "vllm"})
