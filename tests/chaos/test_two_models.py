"""One app, two models (the `chaos` app, tests/chaos/conftest.py: `tiny` on two engine
replicas with its LoRA adapters, OTHER, a gpt-oss mixture of experts, on one): a request's
`model` picks the model, and each answers token for token as transformers' generate on its own
checkpoint (so does each other mixture-of-experts family, on an app of its own for a test);
/v1/models lists both; an unknown model is OpenAI's 404 naming it; adapters go to their base;
/metrics, /v1/cluster and /health tell the models apart. (The fault of one model's replica
under both models' streams: tests/chaos/test_failover.py.)"""

from __future__ import annotations

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from tests.chaos.conftest import APP, OTHER, OTHER_ARCH, chaos_args
from tests.conftest import tiny_model_dir
from tests.engine.oracle import HFOracle

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def client(serve_cluster, chaos_app) -> openai.OpenAI:
    return openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused", max_retries=0)


def _answers_as_transformers(client: openai.OpenAI, name: str, model_dir: str) -> str:
    """`name`'s greedy completion, whole and streamed, equal to transformers' generate on
    `model_dir` (returned); a chat answer."""
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompt = tokenizer.encode("Two models, one door")
    want = tokenizer.decode(HFOracle(model_dir).greedy(prompt, 12))
    kwargs = {"model": name, "prompt": prompt, "max_tokens": 12, "temperature": 0}
    whole = client.completions.create(**kwargs, extra_body={"ignore_eos": True})
    stream = client.completions.create(**kwargs, stream=True, extra_body={"ignore_eos": True})
    streamed = "".join(chunk.choices[0].text for chunk in stream)
    assert (whole.model, whole.choices[0].text, streamed) == (name, want, want)
    chat = client.chat.completions.create(
        model=name, messages=[{"role": "user", "content": "Hi"}], max_tokens=4
    )
    assert chat.model == name and chat.choices[0].finish_reason in ("stop", "length")
    return want


def test_each_model_answers_as_its_own_checkpoint(serve_cluster, client):
    tiny = _answers_as_transformers(client, "tiny", serve_cluster.model)
    other = _answers_as_transformers(client, OTHER, tiny_model_dir(OTHER_ARCH))
    assert tiny != other  # two checkpoints, not one answering for both


def test_every_mixture_of_experts_family_answers_as_transformers(serve_cluster):
    """Mixtral, Qwen2-MoE and Qwen3-MoE (gpt-oss is OTHER) on an app of their own for this
    test, an engine replica each, token for token as transformers' generate over HTTP."""
    from ray import serve

    from serve_app import build_app

    more = ("mixtral", "qwen2-moe", "qwen3-moe")
    lora_off = {"lora": {"enabled": False, "adapters": {}, "search_path": None}}
    # No CPU reserved: the apps beside hold all of the session's.
    replica = {"num_replicas": 1, "num_cpus": 0}
    models = [
        {"model": tiny_model_dir(arch), "served_model_name": f"tiny-{arch}", "engine": lora_off}
        for arch in more
    ]
    args = chaos_args(serve_cluster.model, engine_replicas=replica, ingress_replicas=replica)
    del args["model"], args["served_model_name"]  # (the app's models are `models`)
    serve.run(build_app(args | {"models": models}), name="moe", route_prefix="/moe")
    client = openai.OpenAI(base_url=serve_cluster.v1("moe"), api_key="unused", max_retries=0)
    try:
        answers = [
            _answers_as_transformers(client, f"tiny-{arch}", tiny_model_dir(arch)) for arch in more
        ]
    finally:
        serve.delete("moe", _blocking=False)  # (its replicas wind down beside the next tests)
    assert len(set(answers)) == len(more)


def test_models_lists_both_and_an_unknown_model_is_a_404_naming_it(serve_cluster, client):
    cards = {card.id: card for card in client.models.list().data}
    assert {"tiny", OTHER, "sql"} <= set(cards)
    assert cards["sql"].parent == "tiny"  # the adapters are tiny's alone
    assert cards[OTHER].root == tiny_model_dir(OTHER_ARCH)
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="nope", prompt="Hi", max_tokens=2)
    body = err.value.body
    assert (body["code"], body["param"]) == ("model_not_found", "model")
    assert "`nope`" in body["message"] and f"`tiny`, `{OTHER}`" in body["message"]
    # An adapter by its own name or as base:adapter goes to its base; OTHER takes none.
    for model in ("sql", "tiny:sql"):
        assert client.completions.create(model=model, prompt="Hi", max_tokens=2).choices
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model=f"{OTHER}:sql", prompt="Hi", max_tokens=2)
    base = f"{serve_cluster.base_url}/{APP}"
    counted = httpx.post(f"{base}/tokenize", json={"model": OTHER, "prompt": "Hi"}).json()
    assert counted["count"] >= 1
    resp = httpx.post(
        f"{base}/v1/load_lora_adapter",
        json={"lora_name": "other-sql", "lora_path": "/nowhere", "model": OTHER},
    )
    assert resp.status_code == 400 and "LoRA is not enabled" in resp.json()["error"]["message"]


def test_metrics_cluster_and_health_tell_the_models_apart(serve_cluster, client):
    client.completions.create(model=OTHER, prompt="Count me", max_tokens=2)
    base = f"{serve_cluster.base_url}/{APP}"
    text = httpx.get(f"{base}/metrics", timeout=10).text
    assert f'dynabatch_requests_total{{endpoint="completions",model="{OTHER}",status="200"}}' in (
        text
    )
    for name in ("tiny", OTHER):
        assert f'dynabatch:num_requests_running{{model_name="{name}",' in text
    families = [line.split()[2] for line in text.splitlines() if line.startswith("# TYPE")]
    assert len(families) == len(set(families))  # one family each, both models' series in it
    view = httpx.get(f"{base}/v1/cluster", timeout=10).json()["models"]
    assert set(view) == {"tiny", OTHER} and view[OTHER]["num_replicas"] == 1
    assert httpx.get(f"{base}/health", timeout=30).json() == {"status": "ok"}
