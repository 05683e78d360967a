"""Chaos at a GPU's token rate: an emulated engine replica (an 8B model on an H100, the
`emulated` app, tests/local_serve.py) killed with SIGKILL under 64 streams loses no
request. Its streams go on at the other replica from the tokens already sent, each equal to
what the emulated replica says for its prompt, with no token repeated or missing; every
replica ends with every KV block free."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest
from transformers import AutoTokenizer

from engine.runner.emulated_runner import said_ids
from loadtests.soak.cli import engine_stats
from tests.chaos.conftest import differences, sequences_resumed

pytestmark = pytest.mark.timeout(300)

APP = "emulated"
STREAMS = 64
MAX_TOKENS = 400  # a few seconds at the emulated GPU's rate: time to kill mid-stream


async def _run(url: str, prompts: list[list[int]], started: asyncio.Event) -> list[str]:
    """The prompts streamed at once; `started` is set once each has two chunks."""
    count = 0

    async def one(http: httpx.AsyncClient, prompt: list[int]) -> str:
        nonlocal count
        body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
        text: list[str] = []
        async with http.stream("POST", f"{url}/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                chunk = json.loads(line[len("data: ") :])
                assert "error" not in chunk, chunk
                text += [c["text"] for c in chunk["choices"]]
                if len(text) == 2:
                    count += 1
                    if count == len(prompts):
                        started.set()
        return "".join(text)

    limits = httpx.Limits(max_connections=2 * STREAMS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        return await asyncio.gather(*(one(http, p) for p in prompts))


def _free_everywhere(emulated_app, timeout: float = 90.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(emulated_app.engine_handle(APP), APP, timeout=timeout).values()
        if len(stats) == 2 and all(s["num_free_blocks"] == s["num_total_blocks"] for s in stats):
            return
        assert time.monotonic() < deadline, list(stats)
        time.sleep(0.5)


def test_sigkill_of_an_emulated_replica_under_load_loses_no_request(emulated_app):
    tokenizer = AutoTokenizer.from_pretrained(emulated_app.model)
    text = said_ids(tokenizer)
    # Prompts of different lengths: each says the text from its own position on.
    prompts = [text[: 20 + i] for i in range(STREAMS)]
    expected = [
        tokenizer.decode([text[(len(p) + j) % len(text)] for j in range(MAX_TOKENS)])
        for p in prompts
    ]
    app_url = f"{emulated_app.base_url}/{APP}"
    resumed_before = sequences_resumed(app_url)

    async def disturbed() -> list[str]:
        # Known before the load: asked while it runs, on a busy host the answer came after
        # the streams had ended. Both replicas take some of 64 streams (least loaded first).
        stats = await asyncio.to_thread(engine_stats, emulated_app.engine_handle(APP), APP, 2, 30.0)
        victim = min(stats.values(), key=lambda s: s["pid"])
        started = asyncio.Event()
        run = asyncio.create_task(_run(emulated_app.v1(APP), prompts, started))
        await asyncio.wait_for(started.wait(), 60)
        assert not run.done()
        os.kill(victim["pid"], signal.SIGKILL)
        return await run

    texts = asyncio.run(disturbed())
    assert texts == expected, differences(texts, expected)  # 64 of 64, token for token
    assert sequences_resumed(app_url) > resumed_before  # the victim was serving some
    _free_everywhere(emulated_app)
