"""Chaos: an engine replica killed (SIGKILL) or stopped (SIGSTOP) mid-stream loses no accepted
request. Its streams and whole responses go on at the other replica from the tokens already
sent, equal token for token to an undisturbed run; requests sent just after are served at
once; every replica ends with every KV block free. The cluster controller killed mid-stream
fails no request either: the engines keep their last limits until it is back.

Runs on the `chaos` app (tests/chaos/conftest.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.chaos.conftest import (
    APP,
    OTHER,
    engine_replica_stats,
    run_all,
    run_other,
    sequences_resumed,
)
from tests.local_serve import ServeCluster

pytestmark = pytest.mark.timeout(300)

# The longest a stream of a SIGSTOPped replica may wait for its next chunk: the health
# checks' ~9 s to find it unhealthy, then its resumption elsewhere, on a loaded host.
STALL_WITHIN_S = 30.0


def _free_everywhere(serve_cluster: ServeCluster, timeout: float = 90.0) -> None:
    """Every live replica (the survivor, and the killed one's replacement once up) ends with
    every block free."""
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_replica_stats(serve_cluster, timeout).values()
        if len(stats) == 2 and all(s["num_free_blocks"] == s["num_total_blocks"] for s in stats):
            return
        assert time.monotonic() < deadline, list(stats)
        time.sleep(0.5)


async def _disturbed(
    serve_cluster: ServeCluster, sig: signal.Signals, gaps: list[float] | None = None
) -> tuple[list[str], float, float]:
    """The requests of `run_all`, with `sig` sent mid-stream to the engine replica holding
    most of them; also a request sent just after. Returns the texts, the seconds from the
    signal to the end of the last request, and the seconds the request sent after took;
    each stream's longest wait between chunks goes to `gaps`."""
    base_url = serve_cluster.v1(APP)
    stats = await asyncio.to_thread(engine_replica_stats, serve_cluster)
    victim = min(stats.values(), key=lambda s: s["replica_id"])
    app_url = f"{serve_cluster.base_url}/{APP}"
    resumed_before = sequences_resumed(app_url)
    kill = asyncio.Event()
    run = asyncio.create_task(run_all(base_url, kill, gaps))
    await kill.wait()
    os.kill(victim["pid"], sig)
    try:
        signalled = time.monotonic()
        client = openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0)
        after = await client.completions.create(model="tiny", prompt="after", max_tokens=4)
        assert after.choices[0].finish_reason in ("stop", "length")
        after_s = time.monotonic() - signalled
        texts = await run
        assert sequences_resumed(app_url) > resumed_before  # the victim was serving some
        return texts, time.monotonic() - signalled, after_s
    finally:
        if sig == signal.SIGSTOP:  # Serve has replaced it by now; if not, let it go on
            with contextlib.suppress(ProcessLookupError):
                os.kill(victim["pid"], signal.SIGCONT)


@pytest.fixture(scope="module")
def undisturbed(serve_cluster, chaos_app) -> list[str]:
    started = time.monotonic()
    texts = asyncio.run(run_all(serve_cluster.v1(APP)))
    print(f"undisturbed: {time.monotonic() - started:.1f} s")
    assert all(texts)
    return texts


def test_sigkill_of_an_engine_replica_mid_stream_loses_no_request(serve_cluster, undisturbed):
    """The app's other model streams meanwhile from its own replica, untouched."""
    other_alone = asyncio.run(run_other(serve_cluster.v1(APP)))
    app_url = f"{serve_cluster.base_url}/{APP}"
    other_resumed = sequences_resumed(app_url, OTHER)

    async def beside_other() -> tuple[tuple[list[str], float, float], list[str]]:
        other = asyncio.create_task(run_other(serve_cluster.v1(APP)))
        return await _disturbed(serve_cluster, signal.SIGKILL), await other

    (texts, recovered_s, after_s), other_texts = asyncio.run(beside_other())
    print(f"SIGKILL: all done {recovered_s:.1f} s after; a request sent after took {after_s:.2f} s")
    assert texts == undisturbed  # 16 of 16, token for token
    assert after_s < 15  # served by the survivor, not held for the replica's restart
    assert other_texts == other_alone and sequences_resumed(app_url, OTHER) == other_resumed
    _free_everywhere(serve_cluster)


def test_sigstop_of_an_engine_replica_moves_its_requests_elsewhere(serve_cluster, undisturbed):
    """The stopped replica's streams stall until Serve finds it unhealthy (3 unanswered
    checks of 2 s, 1 s apart), then go on elsewhere: well before request_timeout_s (60 s)
    would have failed them. (How long the rest of the run takes after is the survivor's
    decoding of all 16, which the host's load sets.)"""
    gaps: list[float] = []
    texts, recovered_s, after_s = asyncio.run(_disturbed(serve_cluster, signal.SIGSTOP, gaps))
    print(
        f"SIGSTOP: all done {recovered_s:.1f} s after; a request sent after took {after_s:.2f} "
        f"s; the longest wait in a stream {max(gaps):.1f} s"
    )
    assert texts == undisturbed
    assert len(gaps) == 12 and max(gaps) < STALL_WITHIN_S, sorted(gaps)
    _free_everywhere(serve_cluster)


def test_health_answers_503_while_no_engine_replica_answers(serve_cluster, chaos_app):
    health = f"{serve_cluster.base_url}/{APP}/health"
    assert httpx.get(health, timeout=30).status_code == 200
    pids = [s["pid"] for s in engine_replica_stats(serve_cluster).values()]
    for pid in pids:
        os.kill(pid, signal.SIGSTOP)
    try:
        resp = httpx.get(health, timeout=30)
        assert resp.status_code == 503, resp.text
        models = resp.json()["models"]  # the app's other model still serves
        assert models["tiny"].startswith("no engine replica is healthy") and models[OTHER] == "ok"
    finally:
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
    # Woken (or replaced by Serve meanwhile): healthy and serving again.
    deadline = time.monotonic() + 120
    while httpx.get(health, timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(1)
    client = openai.OpenAI(base_url=serve_cluster.v1(APP), api_key="unused", max_retries=0)
    assert client.completions.create(model="tiny", prompt="back", max_tokens=2).choices
    _free_everywhere(serve_cluster)


def test_killing_the_controller_mid_stream_fails_no_request(serve_cluster, undisturbed):
    """Its reports fail meanwhile (the engines keep their last limits), Serve starts another
    controller, and control resumes."""

    async def run() -> tuple[list[str], dict[str, dict]]:
        kill = asyncio.Event()
        requests = asyncio.create_task(run_all(serve_cluster.v1(APP), kill))
        await kill.wait()
        before = await asyncio.to_thread(engine_replica_stats, serve_cluster)
        # The process's title ends in the method it runs, if any (".report"); not "-gpt-oss".
        found = subprocess.run(
            ["pgrep", "-f", f"ServeReplica:{APP}:ClusterController-tiny([ .]|$)"],
            capture_output=True,
            text=True,
        )
        assert found.stdout.split()
        for pid in found.stdout.split():
            os.kill(int(pid), signal.SIGKILL)
        return await requests, before

    texts, before = asyncio.run(run())
    assert texts == undisturbed  # 16 of 16, token for token
    outage = _stats_once(
        serve_cluster,
        lambda now: all(
            now[r]["num_report_failures"] > before[r]["num_report_failures"] for r in before
        ),
    )
    _stats_once(
        serve_cluster,
        lambda now: all(now[r]["num_reports_ok"] > outage[r]["num_reports_ok"] for r in before),
    )
    _free_everywhere(serve_cluster)


def _stats_once(serve_cluster: ServeCluster, holds, timeout: float = 90.0) -> dict[str, dict]:
    """The engine replicas' stats, polled until `holds(stats)`."""
    deadline = time.monotonic() + timeout
    while not holds(stats := engine_replica_stats(serve_cluster)):
        assert time.monotonic() < deadline, stats
        time.sleep(1)
    return stats
