"""Overload (429), client disconnects (abort + blocks back) and replica choice, for real."""

from __future__ import annotations

import asyncio
import json
import time

import httpx
import pytest

from cluster.prefix_routing import prefix_key, rendezvous_choice
from serve_app.transport.router import adapter_first, with_room_first
from tests.local_serve import NARROW_AUTH

pytestmark = pytest.mark.timeout(300)


def _wait_stats(cluster, app: str, n: int, ok, timeout: float = 15.0) -> dict[str, dict]:
    deadline = time.monotonic() + timeout
    while True:
        stats = cluster.replica_stats(app, n)
        if all(ok(s) for s in stats.values()) or time.monotonic() > deadline:
            return stats
        time.sleep(0.2)


def _idle(s: dict) -> bool:
    return s["num_used_blocks"] == 0 and s["num_streams"] == 0 and s["num_running"] == 0


def test_client_disconnect_aborts_and_frees_blocks(serve_cluster):
    before = serve_cluster.replica_stats("narrow", 1)
    aborted_before = next(iter(before.values()))["num_finished_total"].get("abort", 0)
    body = {
        "model": "tiny",
        "prompt": "a long story",
        "max_tokens": 400,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    with (
        httpx.Client(timeout=30, headers=NARROW_AUTH) as http,
        http.stream("POST", f"{serve_cluster.v1('narrow')}/completions", json=body) as resp,
    ):
        assert resp.status_code == 200
        lines = resp.iter_lines()
        got = [line for line in (next(lines) for _ in range(6)) if line.startswith("data:")]
        assert got and json.loads(got[0][5:])["choices"][0]["text"] is not None
        # Leaving the block closes the connection mid-stream.
    stats = _wait_stats(
        serve_cluster,
        "narrow",
        1,
        lambda s: _idle(s) and s["num_finished_total"].get("abort", 0) > aborted_before,
    )
    s = next(iter(stats.values()))
    assert s["num_finished_total"].get("abort", 0) == aborted_before + 1, s
    assert _idle(s) and s["num_free_blocks"] == s["num_total_blocks"], s


def test_overload_answers_429_and_accepted_requests_complete(serve_cluster):
    """The narrow replica holds 4 (2 running + 2 queued); 12 at once must see 429s. The last
    three go to the Responses API, which turns them away alike."""
    url = serve_cluster.v1("narrow")
    responses = range(9, 12)

    async def one(http: httpx.AsyncClient, i: int) -> tuple[int, dict, dict]:
        body = {"model": "tiny", "temperature": 0, "ignore_eos": True}
        if i in responses:
            body |= {"input": f"request {i}", "max_output_tokens": 120, "store": False}
            resp = await http.post(f"{url}/responses", json=body)
        else:
            body |= {"prompt": f"request {i}", "max_tokens": 120}
            resp = await http.post(f"{url}/completions", json=body)
        return resp.status_code, dict(resp.headers), resp.json()

    async def burst() -> list[tuple[int, dict, dict]]:
        async with httpx.AsyncClient(timeout=120, headers=NARROW_AUTH) as http:
            return await asyncio.gather(*(one(http, i) for i in range(12)))

    started = time.time()
    results = asyncio.run(burst())
    codes = [code for code, _, _ in results]
    assert set(codes) <= {200, 429}, codes
    assert codes.count(429) >= 1 and codes.count(200) >= 4, codes
    for i, (code, headers, body) in enumerate(results):
        if code == 429:
            assert headers.get("retry-after") == "2"
            assert body["error"]["type"] == "rate_limit_error"
        elif i in responses:
            assert body["usage"]["output_tokens"] == 120
        else:
            assert body["usage"]["completion_tokens"] == 120
    # The server kept serving: the next request is accepted and the replica ends idle.
    after = {"model": "tiny", "prompt": "after", "max_tokens": 3}
    ok = httpx.post(f"{url}/completions", json=after, timeout=60, headers=NARROW_AUTH)
    assert ok.status_code == 200
    stats = _wait_stats(serve_cluster, "narrow", 1, _idle)
    s = next(iter(stats.values()))
    assert _idle(s) and s["num_rejected_total"] >= codes.count(429), s
    # The traffic trace holds each of them: the turned-away with the tokens they asked for.
    trace = f"{serve_cluster.base_url}/narrow/v1/cluster/trace"
    resp = httpx.get(trace, params={"since": started}, headers=NARROW_AUTH, timeout=30)
    rows = [json.loads(line) for line in resp.text.splitlines()]
    burst_rows = [row for row in rows if row["prompt_len"] > 1 and row["output_len"] == 120]
    assert sorted(row["rejected"] for row in burst_rows) == sorted(c == 429 for c in codes)
    assert all(row["finish_reason"] == "length" for row in burst_rows if not row["rejected"])
    turned_away = [row for row in burst_rows if row["request_id"].startswith("resp")]
    assert sum(row["rejected"] for row in turned_away) == [codes[i] for i in responses].count(429)
    assert any(row["rejected"] for row in turned_away), codes  # the last three arrive last


def test_prefix_affinity_keeps_a_prefix_on_one_replica(serve_cluster):
    before = serve_cluster.replica_stats("llm", 2)
    shared = "You are a helpful assistant. " * 20  # well over prefix_tokens (64) tokens
    for i in range(8):
        resp = httpx.post(
            f"{serve_cluster.v1()}/completions",
            json={"model": "tiny", "prompt": f"{shared} question {i}", "max_tokens": 2},
            timeout=60,
        )
        assert resp.status_code == 200
    after = serve_cluster.replica_stats("llm", 2)

    def done(s: dict) -> int:
        return sum(s["num_finished_total"].values())

    served = sorted(done(after[r]) - done(before[r]) for r in after)
    assert served == [0, 8], served


def test_rendezvous_choice_is_stable_and_spreads():
    replicas = ["a1", "b2", "c3"]
    picks = [
        rendezvous_choice(prefix_key(list(range(i, i + 64)), 64), replicas) for i in range(300)
    ]
    counts = {r: picks.count(r) for r in replicas}
    assert all(60 < c < 140 for c in counts.values()), counts
    # Removing a replica moves only the prefixes it held.
    fewer = [
        rendezvous_choice(prefix_key(list(range(i, i + 64)), 64), ["a1", "b2"]) for i in range(300)
    ]
    assert all(f == p for f, p in zip(fewer, picks, strict=True) if p != "c3")
    # Only the first prefix_tokens tokens matter.
    assert prefix_key([1, 2, 3, 4], 2) == prefix_key([1, 2, 9], 2)


def test_a_lora_request_goes_where_its_adapter_is_loaded_unless_that_is_busier():
    held = {"a": ["sql"], "b": [], "c": ["sql", "chat"]}
    load = {"a": 3, "b": 0, "c": 1}
    ranked = sorted(held, key=load.get)  # b, c, a

    def ranks(adapter: str, imbalance: int):
        return adapter_first(ranked, held.get, load.get, adapter, imbalance)

    assert ranks("sql", 2) == [["c", "a"], ["b"]]
    assert ranks("sql", 0) is None  # the least loaded holder is busier than b: load first
    assert ranks("code", 2) is None  # held nowhere: load-aware, the replica loads it


def test_a_sequence_with_its_kv_goes_first_where_its_blocks_fit():
    free = {"a": 3, "b": 40, "c": None, "d": 10}  # c: a replica that does not say
    ranked = ["a", "b", "c", "d"]  # least loaded first

    assert with_room_first(ranked, free.get, 10) == [["b", "c", "d"], ["a"]]
    assert with_room_first(ranked, free.get, 20) == [["b", "c"], ["a", "d"]]
    assert with_room_first(ranked, free.get, 3) == [ranked]  # every one has room: by load
    assert with_room_first(["a", "d"], free.get, 50) == [["a", "d"]]  # none has: by load
