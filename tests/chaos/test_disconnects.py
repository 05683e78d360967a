"""Chaos: 200 clients that go away at random moments (before the first byte, mid-stream,
whole requests too), the ingress replica killed under streams of both models, or a client
that stops reading, leave nothing behind: within 10 s every engine replica has no request
and every KV block free, and the app serves the next request."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import socket
import subprocess
import time

import httpx
import pytest

from serve_app.deploy.local_cluster import ingress_url
from tests.chaos.conftest import OTHER, engine_replica_stats

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


def _aborted(stats) -> int:
    return sum(s["num_finished_total"].get("abort", 0) for s in stats)


def _ended(stats) -> int:
    return sum(sum(s["num_finished_total"].values()) for s in stats)


def test_a_client_that_stops_reading_is_cut_and_its_request_aborted(serve_cluster, chaos_app):
    """On the ingress replica's own port (Serve's direct ingress, where the ingress's sends
    wait for the client): 16 choices of 480 tokens with 20 top logprobs each (about 16 MB of
    events) to a socket that reads nothing. Once the kernel's buffers are full and
    max_unsent_tokens (64) wait for a choice, the request is ended: the choices still running
    are aborted and the connection is closed long before the response's end (under half of
    it sent); nothing is left running or holding blocks, and another client is served
    meanwhile. How many choices still run then depends on the host: the ingress, encoding 20
    logprobs a token, is slower than the tiny engine, which on an idle host finished 11 of 16
    before the ingress saw the backlog in one clean run, and all 16 in another."""
    port = int(serve_cluster.base_url.rsplit(":", 1)[1])
    base = ingress_url(chaos_app, port)
    assert base != serve_cluster.base_url  # the test cluster runs direct ingress
    host, direct_port = base.removeprefix("http://").split(":")
    base += f"/{chaos_app}"  # the app's route prefix, as through the proxy
    stats = engine_replica_stats(serve_cluster).values()
    ended_before, aborted_before = _ended(stats), _aborted(stats)
    body = {"model": "tiny", "messages": [{"role": "user", "content": "flood"}], "n": 16}
    body |= {"max_tokens": 480, "ignore_eos": True, "stream": True}
    body |= {"logprobs": True, "top_logprobs": 20}
    data = json.dumps(body).encode()
    head = f"POST /{chaos_app}/v1/chat/completions HTTP/1.1\r\nHost: {host}\r\n"
    head += f"Content-Type: application/json\r\nContent-Length: {len(data)}\r\n\r\n"
    with socket.socket() as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.connect((host, int(direct_port)))
        sock.sendall(head.encode() + data)
        reader = httpx.post(
            f"{base}/v1/completions",
            json={"model": "tiny", "prompt": "reading", "max_tokens": 64, "ignore_eos": True},
            timeout=60,
        )
        assert reader.status_code == 200 and reader.json()["usage"]["completion_tokens"] == 64
        deadline = time.monotonic() + 60
        while True:
            stats = engine_replica_stats(serve_cluster).values()
            idle = all(
                s["num_running"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
                for s in stats
            )
            # The 16 choices (each aborted or done) and the reader's request ended.
            if idle and _ended(stats) - ended_before >= 17:
                break
            assert time.monotonic() < deadline, list(stats)
            time.sleep(0.5)
        if _aborted(stats) == aborted_before:
            # The engine made every choice before the ingress found its client not reading:
            # nothing ran to abort, and the rest waits at the ingress for the client (which
            # leaves here), as any server's unsent bytes do.
            return
        # Cut while choices ran: the server closed the connection, well before the end.
        sock.settimeout(30)
        received = 0
        while chunk := sock.recv(1 << 20):
            received += len(chunk)
    assert 0 < received < 8 << 20


def test_a_killed_ingress_leaves_no_request_running(serve_cluster, chaos_app):
    """16 streams to `tiny` (their deltas on the ingress's delta channels) and 8 to OTHER
    (each on its request's own call): the ingress replica killed, every engine request of
    both is aborted and its blocks freed within 10 s (Ray never closes a dead caller's
    streams: the engine replicas watch the ingress replicas they serve)."""
    url = f"{serve_cluster.v1(chaos_app)}/completions"
    body = {"prompt": "orphan", "max_tokens": 480, "ignore_eos": True, "stream": True}
    streams = {"tiny": 16, OTHER: 8}

    def stats_of(model: str) -> list[dict]:
        return list(engine_replica_stats(serve_cluster, model=model).values())

    async def running(model: str) -> int:
        return sum(s["num_running"] for s in await asyncio.to_thread(stats_of, model))

    async def orphans() -> None:
        async def one(model: str) -> None:
            with contextlib.suppress(httpx.HTTPError):
                async with (
                    httpx.AsyncClient(timeout=120) as client,
                    client.stream("POST", url, json=body | {"model": model}) as resp,
                ):
                    async for _ in resp.aiter_raw():
                        pass

        # (the stats helper blocks: it runs beside this loop)
        before = {m: _aborted(await asyncio.to_thread(stats_of, m)) for m in streams}
        tasks = [asyncio.create_task(one(m)) for m, n in streams.items() for _ in range(n)]
        deadline = time.monotonic() + 60
        for model, count in streams.items():  # at least half of each model's running
            while await running(model) < count // 2:
                assert time.monotonic() < deadline, model
                await asyncio.sleep(0.2)
        found = subprocess.run(
            ["pgrep", "-f", f"ServeReplica:{chaos_app}:OpenAIIngress"],
            capture_output=True,
            text=True,
        )
        for pid in found.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        killed = time.monotonic()
        for model, count in streams.items():
            while True:
                stats = await asyncio.to_thread(stats_of, model)
                if all(
                    s["num_running"] == 0 and s["num_free_blocks"] == s["num_total_blocks"]
                    for s in stats
                ):
                    break
                assert time.monotonic() - killed < 10, (model, stats)
                await asyncio.sleep(0.5)
            # Ended by abort, not run to their 480 tokens.
            assert _aborted(stats) - before[model] >= count // 2, model
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    asyncio.run(orphans())
    deadline = time.monotonic() + 120  # Serve starts another ingress replica
    while True:
        with contextlib.suppress(httpx.HTTPError):
            resp = httpx.post(url, json={"model": "tiny", "prompt": "back", "max_tokens": 2})
            if resp.status_code == 200:
                break
        assert time.monotonic() < deadline
        time.sleep(1)
