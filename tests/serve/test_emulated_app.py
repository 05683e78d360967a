"""The `emulated` app (tests/local_serve.py): two emulated H100 replicas of an 8B model, so
the serving path (ingress, delta channels, SSE) runs at a GPU's token rate."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess

import httpx
import pytest
from transformers import AutoTokenizer

from engine.runner.emulated_runner import said_ids

APP = "emulated"
STREAMS = 128
MAX_TOKENS = 96


def _ingress_counts(cluster) -> dict[str, float]:
    """The ingress's counters of its path to the engine replicas (its /metrics)."""
    text = httpx.get(f"{cluster.base_url}/{APP}/metrics", timeout=10).text
    counts = {}
    for line in text.splitlines():
        if line.startswith("dynabatch_ingress_") and "_total " in line:
            name, value = line.split(" ")
            counts[name.removeprefix("dynabatch_ingress_").removesuffix("_total")] = float(value)
    return counts


def _engine_counts(cluster) -> dict[str, int]:
    stats = cluster.replica_stats(APP, 2).values()
    keys = ("num_steps_total", "channel_deltas_total", "channel_link_batches_total")
    keys += ("link_calls_total",)
    return {key: sum(s[key] for s in stats) for key in keys}


def test_the_models_card_says_it_is_emulated(emulated_app):
    card = httpx.get(f"{emulated_app.v1(APP)}/models", timeout=10).json()["data"][0]
    assert card["id"] == "tiny"
    assert card["emulated"].startswith("Llama-3.1-8B on H100-80GB: no model")


async def _streams(url: str, prompt: list[int]) -> list[tuple[str, int]]:
    """STREAMS streamed completions at once: each one's text and completion tokens."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS, "stream": True}
    body["stream_options"] = {"include_usage": True}

    async def one(http: httpx.AsyncClient) -> tuple[str, int]:
        text, tokens = [], 0
        async with http.stream("POST", f"{url}/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    chunk = json.loads(line[len("data: ") :])
                    text += [c["text"] for c in chunk["choices"]]
                    tokens = (chunk.get("usage") or {}).get("completion_tokens", tokens)
        return "".join(text), tokens

    limits = httpx.Limits(max_connections=2 * STREAMS)
    async with httpx.AsyncClient(timeout=120, limits=limits) as http:
        return await asyncio.gather(*(one(http) for _ in range(STREAMS)))


@pytest.mark.timeout(300)
def test_many_streams_take_a_message_per_step_and_wake_each_response_once_per_step(
    emulated_app,
):
    """128 streams at an emulated H100's rate, with speculation making steps of several
    tokens (the prompt is the text the replica says, twice: prompt lookup finds what comes
    next). The ingress takes at most one Ray message per engine step, and a response wakes
    at most once per engine step: once per delta (a step's tokens), never once per token."""
    tokenizer = AutoTokenizer.from_pretrained(emulated_app.model)
    text = said_ids(tokenizer)
    assert len(text) > MAX_TOKENS
    engine_before, ingress_before = _engine_counts(emulated_app), _ingress_counts(emulated_app)
    results = asyncio.run(_streams(emulated_app.v1(APP), text * 2))
    engine = {k: v - engine_before[k] for k, v in _engine_counts(emulated_app).items()}
    ingress = {k: v - ingress_before[k] for k, v in _ingress_counts(emulated_app).items()}
    # Every stream says the text from its start (position 2n of the text's cycle), whole.
    expected = tokenizer.decode(text[:MAX_TOKENS])
    assert all(said == expected and tokens == MAX_TOKENS for said, tokens in results)
    tokens = STREAMS * MAX_TOKENS
    print(f"{tokens} tokens: ingress {ingress}, engine replicas {engine}")
    # Each request went once to an engine replica, nearly all straight to it (on its delta
    # link once one is open, else to its actor; Serve's handle only while its router knows
    # of no replica with room).
    straight = ingress["engine_calls_direct"] + ingress["engine_calls_on_links"]
    assert straight + ingress["engine_calls_routed"] == STREAMS, ingress
    assert straight >= STREAMS * 3 // 4, ingress
    assert ingress["channel_messages"] <= engine["num_steps_total"], (ingress, engine)
    # Those messages came on the delta links (TCP), not as Ray messages.
    assert ingress["channel_messages"] == engine["channel_link_batches_total"], (ingress, engine)
    assert ingress["channel_deltas"] == engine["channel_deltas_total"], (ingress, engine)
    assert ingress["response_wakeups"] <= ingress["channel_deltas"], ingress
    # Steps of several tokens happened: fewer deltas (and wake-ups) than tokens.
    assert ingress["channel_deltas"] < tokens - STREAMS, (ingress, tokens)


@pytest.mark.timeout(120)
def test_requests_go_on_the_delta_link_once_the_ingress_holds_one(emulated_app):
    """Streams one after another: once this ingress holds a delta link to a replica, its
    requests there go on the link as link calls (not as Ray calls), and each stream says its
    whole text once."""
    tokenizer = AutoTokenizer.from_pretrained(emulated_app.model)
    text = said_ids(tokenizer)
    body = {"model": "tiny", "prompt": text * 2, "max_tokens": 24, "stream": True}
    expected = tokenizer.decode(text[:24])

    def one(http: httpx.Client) -> str:
        said = []
        with http.stream("POST", f"{emulated_app.v1(APP)}/completions", json=body) as resp:
            assert resp.status_code == 200, resp.read()
            for line in resp.iter_lines():
                if line.startswith("data: {"):
                    said += [c["text"] for c in json.loads(line[len("data: ") :])["choices"]]
        return "".join(said)

    with httpx.Client(timeout=60) as http:
        assert one(http) == expected  # a link to its replica is open after this
        engine_before, ingress_before = _engine_counts(emulated_app), _ingress_counts(emulated_app)
        said = [one(http) for _ in range(8)]
    assert said == [expected] * 8
    engine = {k: v - engine_before[k] for k, v in _engine_counts(emulated_app).items()}
    ingress = {k: v - ingress_before[k] for k, v in _ingress_counts(emulated_app).items()}
    print(f"one client, 8 streams: ingress {ingress}, engine replicas {engine}")
    # Two replicas: the first request to the one this ingress held no link to goes by Ray.
    assert ingress["engine_calls_on_links"] >= 7, ingress
    assert engine["link_calls_total"] == ingress["engine_calls_on_links"], (ingress, engine)
    assert ingress["channel_deltas"] == engine["channel_deltas_total"], (ingress, engine)


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("ss") is None, reason="cutting sockets (ss -K) needs root"
)
def test_a_delta_link_cut_mid_stream_loses_no_token(emulated_app):
    """Every delta link's sockets destroyed (`ss -K`, both ends) while 32 streams run: the
    ingress resumes the requests open on them from the tokens their clients have, as when a
    replica dies, so each stream still says the whole text once; the replicas abort their
    end of those requests (every KV block comes back) and later requests link anew."""
    tokenizer = AutoTokenizer.from_pretrained(emulated_app.model)
    text = said_ids(tokenizer)
    max_tokens = 4 * len(text)  # seconds of decoding at an emulated H100's pace
    body = {"model": "tiny", "prompt": text * 2, "max_tokens": max_tokens, "stream": True}
    ports = [s["delta_link_address"][1] for s in emulated_app.replica_stats(APP, 2).values()]
    lost_before = _ingress_counts(emulated_app).get("delta_links_lost", 0)

    async def one(http: httpx.AsyncClient, started: asyncio.Event) -> str:
        said = []
        async with http.stream("POST", f"{emulated_app.v1(APP)}/completions", json=body) as resp:
            assert resp.status_code == 200, await resp.aread()
            async for line in resp.aiter_lines():
                if line.startswith("data: {"):
                    said += [c["text"] for c in json.loads(line[len("data: ") :])["choices"]]
                    started.set()
        return "".join(said)

    async def run() -> list[str]:
        async with httpx.AsyncClient(timeout=120, limits=httpx.Limits(max_connections=64)) as h:
            started = [asyncio.Event() for _ in range(32)]
            streams = asyncio.gather(*(one(h, e) for e in started))
            await asyncio.gather(*(e.wait() for e in started))
            for port in ports:
                cut = f"( sport = :{port} or dport = :{port} )"
                subprocess.run(["ss", "-K", cut], check=True, capture_output=True)
            return await streams

    said = asyncio.run(run())
    expected = tokenizer.decode((text * 5)[:max_tokens])
    assert all(s == expected for s in said), [len(s) for s in said]
    assert _ingress_counts(emulated_app)["delta_links_lost"] > lost_before
    stats = emulated_app.replica_stats(APP, 2).values()
    assert all(s["num_used_blocks"] == 0 and s["num_streams"] == 0 for s in stats), stats
    # The next requests link again: they stream on links, not on Ray.
    before = _engine_counts(emulated_app)["channel_link_batches_total"]
    assert asyncio.run(_streams(emulated_app.v1(APP), text * 2))
    assert _engine_counts(emulated_app)["channel_link_batches_total"] > before
