"""An app whose engine replica spans two tensor-parallel ranks (CPU, gloo): the openai client
gets the tokens of a one-rank replica, and a rank killed mid-stream fails that replica's
requests with an error naming the rank until Serve has replaced the replica. A prefill pool
of two ranks hands every sequence on with its KV to a decode pool of one."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Iterator

import openai
import psutil
import pytest
import ray

from tests.local_serve import ServeCluster, app_args

APP = "tp"
PROMPTS = ["The cat", "Once upon a time, in a kingdom by the sea,"]


@pytest.fixture(scope="module")
def tp_app(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    from serve_app import build_app

    args = app_args(
        serve_cluster.model,
        engine={"tensor_parallel_size": 2},
        engine_replicas={"num_replicas": 1, "num_cpus": 0.5},
        health={"check_period_s": 1, "check_timeout_s": 2},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield APP
    serve.delete(APP)


def _greedy(base_url: str, prompt: str) -> str:
    client = openai.OpenAI(base_url=base_url, api_key="unused", max_retries=0)
    out = client.completions.create(model="tiny", prompt=prompt, max_tokens=24, temperature=0)
    return out.choices[0].text


def _ranks(replica_pid: int) -> list[int]:
    """The rank processes serving the replica (each in its own bundle, started by a RankHost
    actor: not the replica's children)."""
    pattern = f"engine.runner.rank_process [0-9]+ leader={replica_pid} "
    found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
    return [int(pid) for pid in found.stdout.split()]


def test_two_ranks_answer_the_openai_client_as_one_rank(serve_cluster, tp_app):
    for prompt in PROMPTS:
        assert _greedy(serve_cluster.v1(APP), prompt) == _greedy(serve_cluster.v1(), prompt)
    client = openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused")
    stream = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=16,
        temperature=0,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    stats = serve_cluster.engine_handle(APP).stats.remote().result()
    (rank,) = _ranks(stats["pid"])
    # Rank 1 runs in the second bundle of the replica's placement group, started there by a
    # RankHost actor; the group packs both bundles on one node.
    assert psutil.Process(rank).parent().cmdline()[0].startswith("ray::RankHost")
    groups = [
        g
        for g in ray.util.placement_group_table().values()
        if g["state"] == "CREATED" and g["strategy"] == "STRICT_PACK"
    ]
    assert [list(g["bundles"].values()) for g in groups] == [[{"CPU": 0.25}, {"CPU": 0.25}]]


def test_a_killed_rank_fails_its_requests_and_serve_replaces_the_replica(serve_cluster, tp_app):
    import os
    import signal

    before = serve_cluster.engine_handle(APP).stats.remote().result()
    (rank,) = _ranks(before["pid"])
    client = openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused", max_retries=0)
    stream = client.completions.create(
        model="tiny",
        prompt="A long story",
        max_tokens=480,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    with pytest.raises(openai.APIError, match="tensor-parallel rank 1"):
        for i, _ in enumerate(stream):
            if i == 3:
                os.kill(rank, signal.SIGKILL)
    deadline = time.monotonic() + 120
    while True:  # failing requests until Serve has a healthy replica again
        try:
            text = _greedy(serve_cluster.v1(APP), PROMPTS[0])
            after = serve_cluster.engine_handle(APP).stats.remote().result()
            if after["replica_id"] != before["replica_id"]:
                break
        except openai.APIError:
            pass
        assert time.monotonic() < deadline, "the replica was not replaced"
        time.sleep(1)
    assert text == _greedy(serve_cluster.v1(), PROMPTS[0])
    assert len(_ranks(after["pid"])) == 1


def test_a_prefill_pool_of_two_ranks_hands_the_kv_to_a_decode_pool_of_one(serve_cluster, tp_app):
    """Disaggregated, two ranks per prefill replica and one per decode replica: every
    sequence's KV leaves the prefill replica with every head (gathered from its ranks) and
    the decode replica takes it whole; the openai client gets a colocated replica's
    tokens."""
    from ray import serve

    from serve_app import build_app
    from serve_app.deploy.builder import PREFILL_SERVER

    app = "tppd"
    replicas = {"num_replicas": 1, "num_cpus": 0.2}
    args = app_args(
        serve_cluster.model,
        engine_replicas=replicas,
        disaggregation={
            "prefill_replicas": replicas,
            "prefill_engine": {"tensor_parallel_size": 2},
        },
    )
    serve.run(build_app(args), name=app, route_prefix=f"/{app}")
    try:
        for prompt in PROMPTS:
            assert _greedy(serve_cluster.v1(app), prompt) == _greedy(serve_cluster.v1(), prompt)
        prefill = serve.get_deployment_handle(PREFILL_SERVER, app_name=app)
        decode = serve_cluster.engine_handle(app).stats.remote().result()
        assert prefill.stats.remote().result()["num_handed_on"] == len(PROMPTS)
        assert decode["num_kv_carried"] == len(PROMPTS), decode
        assert decode["num_kv_refused"] == decode["num_kv_fetch_failures"] == 0, decode
    finally:
        serve.delete(app)
