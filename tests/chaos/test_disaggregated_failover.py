"""Chaos for prefill and decode pools (`disaggregation`; the `pdchaos` app on the session's
Serve: two prefill and two decode replicas of the tiny model, the chaos suite's health
checks). A decode replica SIGKILLed mid-stream loses no request: its sequences resume at the
other decode replica from the tokens already sent. A prefill replica lost before its
requests' first tokens loses none either: they are sent again, to the other prefill replica.
Texts equal to an undisturbed run's (whose KV went through Ray's object store:
`kv_transport: auto` between CPU replicas); every replica, the replacements included, ends with
every block free."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import openai
import pytest

from loadtests.soak.cli import engine_stats
from serve_app.deploy.builder import PREFILL_SERVER
from tests.chaos.conftest import chaos_args, sequences_resumed
from tests.local_serve import ServeCluster, metric_total

pytestmark = pytest.mark.timeout(300)

APP = "pdchaos"
PROMPTS = [f"Tale {i}: in a land far away" for i in range(8)]
MAX_TOKENS = 160
# Chunks each stream has before the decode replica is killed: the first ones come from the
# prefill replica (its first token, and a step or two before it hands the sequence on).
AT_DECODE_AFTER = 6


@pytest.fixture(scope="module")
def pd_app(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    from serve_app import build_app

    args = chaos_args(
        serve_cluster.model,
        engine_replicas={"num_replicas": 2, "num_cpus": 0},
        disaggregation={"prefill_replicas": {"num_replicas": 2, "num_cpus": 0}},
        # By load, so each prefill replica takes its share of PROMPTS: by their prefixes'
        # hash all eight could go to one, and a victim given none would be sent nothing.
        routing={"prefix_affinity": False},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield APP
    serve.delete(APP)


async def _streams(base_url: str, started: asyncio.Event | None = None) -> list[str]:
    """PROMPTS streamed at once, greedy; `started` is set once each has AT_DECODE_AFTER
    chunks."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
    count = 0

    async def one(prompt: str) -> str:
        nonlocal count
        text: list[str] = []
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=MAX_TOKENS,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            if len(text) == AT_DECODE_AFTER:
                count += 1
                if started is not None and count == len(PROMPTS):
                    started.set()
        return "".join(text)

    return list(await asyncio.gather(*(one(p) for p in PROMPTS)))


def _pool(deployment: str, count: int = 2, timeout: float = 120.0) -> dict[str, dict]:
    from ray import serve

    handle = serve.get_deployment_handle(deployment, app_name=APP)
    seen = engine_stats(handle, APP, count=count, timeout=timeout)
    assert seen, f"{deployment}: {count} replicas did not answer within {timeout:g} s"
    return seen


def _free_everywhere(timeout: float = 120.0) -> None:
    """Both pools back to two replicas each, every block free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = [*_pool(PREFILL_SERVER).values(), *_pool("EngineServer").values()]
        if all(s["num_used_blocks"] == 0 for s in stats):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.5)


def _engine_calls(serve_cluster: ServeCluster) -> float:
    """The ingress's engine calls, direct and through Serve's handle (sends again included)."""
    return metric_total(
        f"{serve_cluster.base_url}/{APP}",
        "dynabatch_ingress_engine_calls_direct_total ",
        "dynabatch_ingress_engine_calls_routed_total ",
    )


@pytest.fixture(scope="module")
def undisturbed(serve_cluster: ServeCluster, pd_app: str) -> list[str]:
    texts = asyncio.run(_streams(serve_cluster.v1(APP)))
    assert all(texts)
    # Every sequence came to its decode replica with its prompt's KV, through the object
    # store (kv_transport auto, from a CPU's cache).
    decoding = _pool("EngineServer").values()
    assert sum(s["num_kv_carried"] for s in decoding) == len(PROMPTS), list(decoding)
    assert not any(s["kv_link_taken"]["host"] + s["kv_link_taken"]["p2p"] for s in decoding)
    return texts


def test_a_decode_replica_killed_mid_stream_loses_no_request(serve_cluster, undisturbed):
    app_url = f"{serve_cluster.base_url}/{APP}"
    resumed_before = sequences_resumed(app_url)

    async def disturbed() -> list[str]:
        started = asyncio.Event()
        run = asyncio.create_task(_streams(serve_cluster.v1(APP), started))
        await started.wait()
        decoding = await asyncio.to_thread(_pool, "EngineServer")
        victim = max(decoding.values(), key=lambda s: s["num_running"])
        assert victim["num_running"] > 0, list(decoding.values())
        os.kill(victim["pid"], signal.SIGKILL)
        return await run

    assert asyncio.run(disturbed()) == undisturbed
    assert sequences_resumed(app_url) > resumed_before  # the victim was decoding some
    _free_everywhere()


def test_a_prefill_replica_lost_before_first_tokens_loses_no_request(serve_cluster, undisturbed):
    """The victim stops (SIGSTOP) with requests on their way to it, then dies (SIGKILL):
    they were sent again, to the other prefill replica."""
    victim = min(_pool(PREFILL_SERVER).values(), key=lambda s: s["replica_id"])
    calls_before = _engine_calls(serve_cluster)

    async def disturbed() -> list[str]:
        os.kill(victim["pid"], signal.SIGSTOP)
        try:
            run = asyncio.create_task(_streams(serve_cluster.v1(APP)))
            await asyncio.sleep(2)  # some of them wait at the stopped replica
            os.kill(victim["pid"], signal.SIGKILL)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGCONT)
        return await run

    assert asyncio.run(disturbed()) == undisturbed
    # A prefill send and a decode send per request, and more: those sent again.
    assert _engine_calls(serve_cluster) - calls_before > 2 * len(PROMPTS)
    _free_everywhere()
