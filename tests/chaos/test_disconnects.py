"""Chaos: 200 clients that go away at random moments (before the first byte, mid-stream,
whole requests too) leave nothing behind: within 10 s every engine replica has no request
and every KV block free, and the app serves the next request."""

from __future__ import annotations

import asyncio
import random
import time

import httpx
import pytest

from tests.chaos.conftest import engine_replica_stats

pytestmark = pytest.mark.timeout(300)


async def _leave_at_random(url: str, rng: random.Random, count: int, concurrency: int) -> int:
    """`count` requests, `concurrency` at a time, each cancelled after a random delay (some
    finish first). Returns how many were cut."""
    gate = asyncio.Semaphore(concurrency)
    cut = 0

    async def one(client: httpx.AsyncClient, i: int) -> None:
        nonlocal cut
        body = {"model": "tiny", "prompt": f"Leaving {i} " * rng.randint(1, 20)}
        body |= {"max_tokens": rng.randint(8, 200), "ignore_eos": True}
        body["stream"] = rng.random() < 0.8
        after = rng.choice([0.0, 0.005, 0.02, 0.1, 0.3, 1.0])

        async def request() -> None:
            async with client.stream("POST", f"{url}/completions", json=body) as resp:
                async for _ in resp.aiter_raw():
                    pass

        async with gate:
            try:
                await asyncio.wait_for(request(), after)
            except TimeoutError:
                cut += 1

    async with httpx.AsyncClient(timeout=60) as client:
        await asyncio.gather(*(one(client, i) for i in range(count)))
    return cut


def test_two_hundred_random_disconnects_leave_no_request_and_no_block(serve_cluster, chaos_app):
    cut = asyncio.run(
        _leave_at_random(serve_cluster.v1(chaos_app), random.Random(7), count=200, concurrency=32)
    )
    assert cut > 100  # most left before their end
    deadline = time.monotonic() + 10
    while True:
        stats = engine_replica_stats(serve_cluster).values()
        idle = [
            s["num_streams"] == 0
            and s["num_running"] == 0
            and s["num_free_blocks"] == s["num_total_blocks"]
            for s in stats
        ]
        if all(idle):
            break
        assert time.monotonic() < deadline, list(stats)
        time.sleep(0.2)
    resp = httpx.post(
        f"{serve_cluster.v1(chaos_app)}/completions",
        json={"model": "tiny", "prompt": "still here", "max_tokens": 3},
        timeout=30,
    )
    assert resp.status_code == 200
