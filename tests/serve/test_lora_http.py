"""LoRA adapters over HTTP with the openai client: `model="tiny:sql"` and `model="sql"`
are served (mixed with other adapters and the base model, in one batch), an unknown adapter
is a 404 naming it, adapters load and unload at run time, a malformed one is a 400 naming
the file, and everyone else is served meanwhile."""

from __future__ import annotations

import shutil
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import openai
import pytest

from engine.core.sampling_params import SamplingParams
from engine.lora.adapter import WEIGHTS_FILE
from serve_app.config import AppArgs
from tests.lora_adapters import lora_adapters

pytestmark = pytest.mark.timeout(300)

PROMPTS = ["SELECT name FROM", "Hello there,", "def main():", "The weather today"]


@pytest.fixture(scope="module")
def reference(serve_cluster):
    """The app's engine settings in process: the greedy text of each (prompt, adapter)."""
    from engine.llm_engine import LLMEngine

    engine = LLMEngine(
        AppArgs.model_validate(serve_cluster.args).engine.engine_config(serve_cluster.model)
    )
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)

    def text(prompt: str, lora: str | None) -> str:
        return engine.generate([prompt], params, [lora])[0].text

    return text


@pytest.fixture(scope="module")
def client(serve_cluster) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)


def complete(client: openai.OpenAI, model: str, prompt: str) -> str:
    out = client.completions.create(
        model=model, prompt=prompt, max_tokens=12, temperature=0.0, extra_body={"ignore_eos": True}
    )
    return out.choices[0].text


def test_adapters_by_either_name_in_mixed_batches(client, reference):
    models = ["tiny:sql", "sql", "chat", "tiny:code", "tiny"]
    jobs = [(m, p) for m in models for p in PROMPTS]
    with ThreadPoolExecutor(len(jobs)) as pool:  # concurrent: adapters share batches
        texts = list(pool.map(lambda job: complete(client, *job), jobs))
    for (model, prompt), text in zip(jobs, texts, strict=True):
        adapter = None if model == "tiny" else model.removeprefix("tiny:")
        assert text == reference(prompt, adapter), (model, prompt)
    assert texts[0] != texts[-len(PROMPTS)]  # the adapter changes the output


def test_streamed_chat_with_an_adapter(client):
    stream = client.chat.completions.create(
        model="tiny:chat",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=8,
        stream=True,
    )
    chunks = [c for c in stream]
    assert chunks and all(c.model == "tiny:chat" for c in chunks)


def test_unknown_adapter_is_a_404_naming_it(client):
    for model in ("nope", "tiny:nope"):
        with pytest.raises(openai.NotFoundError) as err:
            complete(client, model, "x")
        body = err.value.body
        assert body["code"] == "model_not_found" and body["param"] == "model"
        assert model in body["message"]


def test_models_lists_the_adapters(client):
    cards = client.models.list().data
    assert cards[0].id == "tiny"
    assert {"sql", "chat", "code"} <= {c.id for c in cards[1:]}
    assert client.models.retrieve("sql").id == "sql"


def test_load_and_unload_at_run_time(serve_cluster, client, reference, tmp_path):
    base = serve_cluster.base_url
    adapters = lora_adapters(serve_cluster.model)
    path = shutil.copytree(adapters["code"], tmp_path / "code-copy")
    with pytest.raises(openai.NotFoundError):
        complete(client, "ops", PROMPTS[0])
    body = {"lora_name": "ops", "lora_path": str(path)}
    resp = httpx.post(f"{base}/v1/load_lora_adapter", json=body)
    assert resp.status_code == 200, resp.text
    assert complete(client, "tiny:ops", PROMPTS[0]) == reference(PROMPTS[0], "code")
    assert "ops" in {c.id for c in client.models.list().data}
    resp = httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "ops"})
    assert resp.status_code == 200, resp.text
    with pytest.raises(openai.NotFoundError):
        complete(client, "ops", PROMPTS[0])
    assert (
        httpx.post(f"{base}/v1/unload_lora_adapter", json={"lora_name": "ops"}).status_code == 404
    )


def test_a_malformed_adapter_is_a_400_naming_the_file(serve_cluster, client, reference, tmp_path):
    broken = shutil.copytree(lora_adapters(serve_cluster.model)["chat"], tmp_path / "broken")
    (broken / WEIGHTS_FILE).write_bytes(b"not safetensors")
    body = {"lora_name": "broken", "lora_path": str(broken)}
    resp = httpx.post(f"{serve_cluster.base_url}/v1/load_lora_adapter", json=body)
    assert resp.status_code == 400
    assert resp.json()["error"]["param"] == WEIGHTS_FILE and WEIGHTS_FILE in resp.text
    assert complete(client, "tiny", PROMPTS[1]) == reference(PROMPTS[1], None)  # others go on


def test_loading_adapters_needs_the_api_key_where_keys_are_set(serve_cluster):
    body = {"lora_name": "x", "lora_path": "/nowhere"}
    resp = httpx.post(f"{serve_cluster.base_url}/narrow/v1/load_lora_adapter", json=body)
    assert resp.status_code == 401


def test_metrics_show_each_replicas_adapters(serve_cluster, client):
    complete(client, "sql", PROMPTS[0])
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the replicas push their metrics every period
        text = httpx.get(f"{serve_cluster.base_url}/metrics").text
        lines = [line for line in text.splitlines() if line.startswith("dynabatch:lora_")]
        if any('max_lora="2"' in line for line in lines):
            return
        time.sleep(0.5)
    raise AssertionError(f"no lora_requests_info in /metrics: {lines}")


def test_requests_for_an_adapter_go_where_it_is_loaded(serve_cluster, client, tmp_path):
    path = shutil.copytree(lora_adapters(serve_cluster.model)["chat"], tmp_path / "probe")
    body = {"lora_name": "probe", "lora_path": str(path)}
    assert (
        httpx.post(f"{serve_cluster.base_url}/v1/load_lora_adapter", json=body).status_code == 200
    )
    complete(client, "probe", PROMPTS[0])
    time.sleep(2.5)  # the replicas report what they hold every second
    for prompt in PROMPTS:
        complete(client, "probe", prompt)
    holders = [s for s in serve_cluster.replica_stats("llm", 2).values() if "probe" in s["loras"]]
    assert len(holders) == 1
