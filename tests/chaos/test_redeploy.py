"""Chaos: a redeploy mid-stream (new args: every replica, ingress and engines, is replaced, and
the engines go from 2 to 1) cuts no stream. Each old engine replica moves its sequences with
their KV to the new one as soon as Serve starts stopping it (health.move_on_stop), and is gone
in seconds; 16 of 16 requests end with the texts of an undisturbed run, none of their contexts
computed again."""

from __future__ import annotations

import asyncio
import time

import pytest

from serve_app.deploy.builder import deployment_name
from tests.chaos.conftest import APP, deploy, engine_replica_stats, run_all

pytestmark = pytest.mark.timeout(420)

# While another runs, a stopping engine replica is gone within this (Serve checks its
# ongoing requests every 2 s), where it used to finish its streams first.
MOVED_AWAY_WITHIN_S = 10.0
ENGINES = deployment_name("EngineServer", "tiny")  # the chaos app's tiny engines


def test_a_redeploy_mid_stream_cuts_no_stream(serve_cluster, chaos_app):
    base_url = serve_cluster.v1(chaos_app)
    began = time.monotonic()
    undisturbed = asyncio.run(run_all(base_url))
    undisturbed_s, began = time.monotonic() - began, time.monotonic()

    async def redeployed() -> tuple[list[str], float]:
        started = asyncio.Event()
        run = asyncio.create_task(run_all(base_url, started))
        await started.wait()
        watch = asyncio.create_task(asyncio.to_thread(longest_stop, run))
        one_engine = {"engine_replicas": {"num_replicas": 1, "num_cpus": 0.5}}
        await asyncio.to_thread(deploy, serve_cluster, **one_engine)
        return await run, await watch

    # (Last of the chaos suite by name: the app keeps its one engine replica.)
    texts, stopping_s = asyncio.run(redeployed())
    assert texts == undisturbed
    # The old replicas moved their sequences, with their KV, to the new one and went while
    # the streams went on there (they used to finish the streams first).
    (new,) = engine_replica_stats(serve_cluster).values()
    print(
        f"undisturbed run {undisturbed_s:.1f} s, redeployed {time.monotonic() - began:.1f} s; "
        f"old engine replicas stopped in {stopping_s:.1f} s; the KV of "
        f"{new['num_kv_tokens_carried']} tokens moved with {new['num_kv_carried']} sequences"
    )
    assert new["num_moved_in"] == new["num_kv_carried"] > len(texts) // 2, new
    assert new["num_kv_refused"] == new["num_kv_fetch_failures"] == 0, new
    assert 0 < stopping_s < MOVED_AWAY_WITHIN_S, stopping_s


def longest_stop(run: asyncio.Task) -> float:
    """The longest time an engine replica of the chaos app's `tiny` spent stopping while
    another ran (one to move to), as seen while `run` goes on."""
    from ray import serve

    stopping_since, longest = None, 0.0
    while not run.done():
        states = serve.status().applications[APP].deployments[ENGINES].replica_states
        now = time.monotonic()
        if states.get("STOPPING", 0) and states.get("RUNNING", 0):
            stopping_since = stopping_since or now
            longest = max(longest, now - stopping_since)
        else:
            stopping_since = None
        time.sleep(0.2)
    return longest
