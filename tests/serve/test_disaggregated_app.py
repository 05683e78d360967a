"""An app with separate prefill and decode pools (`disaggregation`, issue 59 item 2), one
engine replica each: every sequence prefills at the prefill replica, which sends its first
token and moves it with its prompt's KV to the decode replica. Over HTTP with the openai
client: greedy tokens are transformers' generate's, seeded sampling gives the colocated
app's tokens, a LoRA adapter's tokens are the colocated app's, a one-token request ends at
the prefill replica, a stream the client leaves frees its blocks, every handed-on sequence
came with its KV straight from the prefill replica (`kv_transport: link`; no prompt computed
twice), and both replicas end with every block free. The prefill replica runs its own engine
knobs (`prefill_engine`) and finds repeated prompts in its prefix cache."""

from __future__ import annotations

import time
from collections.abc import Iterator

import openai
import pytest
from transformers import AutoTokenizer

from serve_app.deploy.builder import PREFILL_SERVER
from tests.engine.oracle import HFOracle
from tests.local_serve import ServeCluster, app_args, metric_total

pytestmark = pytest.mark.timeout(300)

APP = "pd"
PROMPTS = ["Split the work:", "Prefill here, decode there, and the cache moves between them"]
HANDED_ON = "dynabatch_ingress_sequences_handed_on_total "


@pytest.fixture(scope="module")
def pd_app(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    from serve_app import build_app

    args = app_args(
        serve_cluster.model,
        engine_replicas={"num_replicas": 1, "num_cpus": 0},
        disaggregation={
            "prefill_replicas": {"num_replicas": 1, "num_cpus": 0},
            # Its own knobs: a bigger prefill budget; no drafting where one token is made.
            "prefill_engine": {"max_num_batched_tokens": 1024, "speculative": {"enabled": False}},
        },
        kv_transport="link",  # the object store's way: tests/chaos/test_disaggregated_failover
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield APP
    serve.delete(APP)


def _handle(deployment: str):
    from ray import serve

    return serve.get_deployment_handle(deployment, app_name=APP)


def _stats(deployment: str) -> dict:
    return _handle(deployment).stats.remote().result()


def _all_free(timeout: float = 30.0) -> tuple[dict, dict]:
    """The prefill and decode replicas' stats once both hold no block (nor the prefill
    replica any KV offered on its link)."""
    deadline = time.monotonic() + timeout
    while True:
        prefill, decode = _stats(PREFILL_SERVER), _stats("EngineServer")
        held = prefill["num_kv_offers_held"]
        if prefill["num_used_blocks"] == decode["num_used_blocks"] == held == 0:
            return prefill, decode
        assert time.monotonic() < deadline, (prefill, decode)
        time.sleep(0.2)


def _handed_on_at_ingress(serve_cluster: ServeCluster) -> float:
    """The ingress's count of sequences handed from a prefill replica to a decode one."""
    return metric_total(f"{serve_cluster.base_url}/{APP}", HANDED_ON)


def test_prefill_and_decode_on_separate_replicas_answer_as_transformers(
    serve_cluster: ServeCluster, pd_app: str
):
    client = openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused", max_retries=0)
    tokenizer = AutoTokenizer.from_pretrained(serve_cluster.model)
    oracle = HFOracle(serve_cluster.model)
    before_prefill, before_decode = _all_free()
    ingress_before = _handed_on_at_ingress(serve_cluster)
    sent = 0
    for text in PROMPTS:
        prompt = tokenizer.encode(text)
        want = tokenizer.decode(oracle.greedy(prompt, 24))
        kwargs = {"model": "tiny", "prompt": prompt, "max_tokens": 24, "temperature": 0}
        kwargs["extra_body"] = {"ignore_eos": True}
        whole = client.completions.create(**kwargs)
        stream = client.completions.create(**kwargs, stream=True)
        streamed = "".join(chunk.choices[0].text for chunk in stream)
        assert (whole.choices[0].text, streamed) == (want, want)
        sent += 2
    # Seeded sampling draws by the seed and the token's index: the same across the move.
    sampled = {"prompt": PROMPTS[1], "max_tokens": 32, "temperature": 0.9, "seed": 7}
    colocated = openai.OpenAI(base_url=serve_cluster.v1(), api_key="unused", max_retries=0)
    want = colocated.completions.create(model="tiny", **sampled).choices[0].text
    assert client.completions.create(model="tiny", **sampled).choices[0].text == want
    sent += 1
    chat = client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hello"}], max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].delta.content or "" for c in chat if c.choices)
    sent += 1
    # A LoRA adapter's request: the prefill replica computes its prompt with the adapter,
    # the decode replica goes on with it.
    adapter = {"prompt": PROMPTS[0], "max_tokens": 16, "temperature": 0}
    want = colocated.completions.create(model="sql", **adapter).choices[0].text
    assert client.completions.create(model="sql", **adapter).choices[0].text == want
    sent += 1
    # A stream the client leaves after a few chunks: aborted at the decode replica.
    left = client.completions.create(
        model="tiny",
        prompt=PROMPTS[1],
        max_tokens=400,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    for _, _chunk in zip(range(4), left, strict=False):
        pass
    left.close()
    sent += 1
    # One token: it ends where it prefilled, nothing to move.
    one = client.completions.create(model="tiny", prompt=PROMPTS[0], max_tokens=1)
    assert one.choices[0].finish_reason == "length"

    prefill, decode = _all_free()
    assert prefill["max_num_batched_tokens"] == 1024 and prefill["spec"] is None, prefill
    # The prefill pool caches prefixes: each prompt above went to it more than once.
    assert prefill["prefix_cache_hits"] > before_prefill["prefix_cache_hits"], prefill
    assert decode["max_num_batched_tokens"] != 1024 and decode["spec"] is not None, decode
    # The router places a sequence that comes with its KV where its blocks fit: the decode
    # replica publishes its free blocks.
    routing = _handle("EngineServer").record_routing_stats.remote().result()
    assert routing["kv_free_blocks"] == decode["num_free_blocks"] > 0
    handed_on = prefill["num_handed_on"] - before_prefill["num_handed_on"]
    moved_in = decode["num_moved_in"] - before_decode["num_moved_in"]
    carried = decode["num_kv_carried"] - before_decode["num_kv_carried"]
    assert handed_on == moved_in == carried == sent, (prefill, decode)
    assert decode["num_kv_refused"] == decode["num_kv_fetch_failures"] == 0, decode
    # Each KV went straight from the prefill replica to the decode one (kv_transport: link;
    # between CPUs on the connection itself).
    taken = decode["kv_link_taken"]["host"] - before_decode["kv_link_taken"]["host"]
    assert taken == sent and decode["num_kv_link_p2p_failures"] == 0, decode
    assert _handed_on_at_ingress(serve_cluster) - ingress_before == sent
