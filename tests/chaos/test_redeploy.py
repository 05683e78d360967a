"""Chaos: a redeploy mid-stream (new args: every replica, ingress and engines, is replaced)
cuts no stream. Serve's rolling update stops one old engine replica, starts a new one, and
stops the other old one once the new one runs; each moves its sequences with their KV to a
running replica as soon as Serve starts stopping it (health.move_on_stop), and is gone in
seconds. The 16 requests are sent again as each ends until the redeploy is done (a new
replica takes longer to start on a loaded host than one request lasts), and every answer is
an undisturbed run's; none of the moved contexts is computed again."""

from __future__ import annotations

import asyncio
import threading
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
        started, deployed = asyncio.Event(), threading.Event()
        run = asyncio.create_task(run_all(base_url, started, until=deployed.is_set))
        await started.wait()
        watch = asyncio.create_task(asyncio.to_thread(longest_stop, run))
        new_engines = {"engine_replicas": {"num_replicas": 2, "num_cpus": 0.4}}
        try:
            await asyncio.to_thread(deploy, serve_cluster, **new_engines)
        finally:
            deployed.set()
        return await run, await watch

    texts, stopping_s = asyncio.run(redeployed())
    assert texts == undisturbed  # and every answer sent again equal to its first
    # The old replica stopped last moved its sequences, with their KV, to the first new one
    # and went while the streams went on there (they used to finish the streams first).
    new = engine_replica_stats(serve_cluster).values()
    moved_in, carried = (sum(s[key] for s in new) for key in ("num_moved_in", "num_kv_carried"))
    print(
        f"undisturbed run {undisturbed_s:.1f} s, redeployed {time.monotonic() - began:.1f} s; "
        f"old engine replicas stopped in {stopping_s:.1f} s; the KV of "
        f"{sum(s['num_kv_tokens_carried'] for s in new)} tokens moved with {carried} sequences"
    )
    assert len(new) == 2 and moved_in == carried > 0, list(new)
    assert all(s["num_kv_refused"] == s["num_kv_fetch_failures"] == 0 for s in new), list(new)
    assert 0 < stopping_s < MOVED_AWAY_WITHIN_S, f"longest stop seen: {stopping_s} s (0: none seen)"


def longest_stop(run: asyncio.Task) -> float:
    """The longest time an engine replica of the chaos app's `tiny` spent stopping while
    another ran (one to move to), as seen while `run` goes on: from the first look that saw
    it stopping to the first that did not, so a stop shorter than the time between two looks
    still counts (as that time) rather than as 0."""
    from ray import serve

    stopping_since, longest = None, 0.0
    while not run.done():
        states = serve.status().applications[APP].deployments[ENGINES].replica_states
        now = time.monotonic()
        if states.get("STOPPING", 0) and states.get("RUNNING", 0):
            stopping_since = stopping_since or now
        elif stopping_since is not None:
            longest, stopping_since = max(longest, now - stopping_since), None
        time.sleep(0.2)
    if stopping_since is not None:  # still stopping when the streams ended
        longest = max(longest, time.monotonic() - stopping_since)
    return longest
