"""Chaos: an engine replica killed (SIGKILL) mid-stream loses no accepted request. Its
streams and whole responses go on at the other replica from the tokens already sent, equal
token for token to an undisturbed run; requests sent just after are served at once; every
replica ends with every KV block free.

Runs its own app (`chaos`, 2 engine replicas, 1 ingress) on the session's local Serve, so
the replica it kills serves nobody else's tests."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator

import httpx
import openai
import pytest

from tests.local_serve import ServeCluster, app_args

pytestmark = pytest.mark.timeout(300)

APP = "chaos"
PROMPTS = [f"Story {i}: once upon a time" for i in range(16)]
MAX_TOKENS = 400


@pytest.fixture(scope="module")
def chaos_app(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    from serve_app import build_app

    args = app_args(
        serve_cluster.model,
        request_timeout_s=60,
        health={"check_period_s": 1, "check_timeout_s": 2},
    )
    serve.run(build_app(args), name=APP, route_prefix=f"/{APP}")
    yield APP
    serve.delete(APP)


async def _run_all(base_url: str, kill: asyncio.Event | None = None) -> list[str]:
    """PROMPTS[:12] streamed and PROMPTS[12:] whole, greedy; returns their texts. With `kill`,
    set it once every stream has its first tokens."""
    client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
    kwargs = dict(model="tiny", max_tokens=MAX_TOKENS, temperature=0)
    kwargs["extra_body"] = {"ignore_eos": True}
    started = 0

    async def streamed(prompt: str) -> str:
        nonlocal started
        text, counted = [], False
        async for chunk in await client.completions.create(prompt=prompt, stream=True, **kwargs):
            text.append(chunk.choices[0].text)
            if not counted and len(text) >= 4:
                counted, started = True, started + 1
                if kill is not None and started == 12:
                    kill.set()
        return "".join(text)

    async def whole(prompt: str) -> str:
        return (await client.completions.create(prompt=prompt, **kwargs)).choices[0].text

    tasks = [streamed(p) for p in PROMPTS[:12]] + [whole(p) for p in PROMPTS[12:]]
    return list(await asyncio.gather(*tasks))


def _resumed(serve_cluster: ServeCluster) -> float:
    """The chaos app's count of sequences resumed at another replica."""
    metrics = httpx.get(f"{serve_cluster.base_url}/{APP}/metrics", timeout=10).text
    for line in metrics.splitlines():
        if line.startswith("dynabatch_sequences_resumed_total{"):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def _free_everywhere(serve_cluster: ServeCluster, timeout: float = 90.0) -> None:
    """Every live replica (the survivor, and the killed one's replacement once up) ends with
    every block free."""
    handle = serve_cluster.engine_handle(APP)
    deadline = time.monotonic() + timeout
    seen: dict[str, dict] = {}

    def all_free() -> bool:
        return all(s["num_free_blocks"] == s["num_total_blocks"] for s in seen.values())

    while len(seen) < 2 or not all_free():
        assert time.monotonic() < deadline, seen
        try:
            stats = handle.stats.remote().result(timeout_s=5)
        except Exception:  # routed to the dead replica before Serve noticed
            time.sleep(0.5)
            continue
        seen[stats["replica_id"]] = stats


async def _disturbed(
    serve_cluster: ServeCluster, sig: signal.Signals
) -> tuple[list[str], float, float]:
    """The requests of `_run_all`, with `sig` sent mid-stream to the engine replica holding
    most of them; also a request sent just after. Returns the texts, the seconds from the
    signal to the end of the last request, and the seconds the request sent after took."""
    base_url = serve_cluster.v1(APP)
    stats = await asyncio.to_thread(serve_cluster.replica_stats, APP, 2)
    victim = min(stats.values(), key=lambda s: s["replica_id"])
    resumed_before = _resumed(serve_cluster)
    kill = asyncio.Event()
    run = asyncio.create_task(_run_all(base_url, kill))
    await kill.wait()
    os.kill(victim["pid"], sig)
    try:
        signalled = time.monotonic()
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        after = await client.completions.create(model="tiny", prompt="after", max_tokens=4)
        assert after.choices[0].finish_reason in ("stop", "length")
        after_s = time.monotonic() - signalled
        texts = await run
        assert _resumed(serve_cluster) > resumed_before  # the victim was serving some
        return texts, time.monotonic() - signalled, after_s
    finally:
        if sig == signal.SIGSTOP:  # Serve has replaced it by now; if not, let it go on
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGCONT)


@pytest.fixture(scope="module")
def undisturbed(serve_cluster, chaos_app) -> list[str]:
    started = time.monotonic()
    texts = asyncio.run(_run_all(serve_cluster.v1(APP)))
    print(f"undisturbed: {time.monotonic() - started:.1f} s")
    assert all(texts)
    return texts


def test_sigkill_of_an_engine_replica_mid_stream_loses_no_request(serve_cluster, undisturbed):
    texts, recovered_s, after_s = asyncio.run(_disturbed(serve_cluster, signal.SIGKILL))
    print(f"SIGKILL: all done {recovered_s:.1f} s after; a request sent after took {after_s:.2f} s")
    assert texts == undisturbed  # 16 of 16, token for token
    assert after_s < 15  # served by the survivor, not held for the replica's restart
    _free_everywhere(serve_cluster)


def test_sigstop_of_an_engine_replica_moves_its_requests_elsewhere(serve_cluster, undisturbed):
    # The app's health settings: 3 unanswered checks of 2 s, 1 s apart, then Serve replaces it.
    texts, recovered_s, after_s = asyncio.run(_disturbed(serve_cluster, signal.SIGSTOP))
    print(f"SIGSTOP: all done {recovered_s:.1f} s after; a request sent after took {after_s:.2f} s")
    assert texts == undisturbed
    assert recovered_s < 45
    _free_everywhere(serve_cluster)
