"""Chaos: a redeploy mid-stream (new args: every replica, ingress and engines, is replaced, and
the engines go from 2 to 1) cuts no stream. Serve drains each old replica for its
graceful_shutdown_timeout_s (the engines' from `health:`), and a stream that outlived it would
resume at a new replica; 16 of 16 requests end with the texts of an undisturbed run."""

from __future__ import annotations

import asyncio
import time

import pytest

from tests.chaos.conftest import deploy, engine_replica_stats, run_all

pytestmark = pytest.mark.timeout(300)


def test_a_redeploy_mid_stream_cuts_no_stream(serve_cluster, chaos_app):
    base_url = serve_cluster.v1(chaos_app)
    undisturbed = asyncio.run(run_all(base_url))

    async def redeployed() -> list[str]:
        started = asyncio.Event()
        run = asyncio.create_task(run_all(base_url, started))
        await started.wait()
        one_engine = {"engine_replicas": {"num_replicas": 1, "num_cpus": 0.5}}
        await asyncio.to_thread(deploy, serve_cluster, **one_engine)
        return await run

    # (Last of the chaos suite by name: the app keeps its one engine replica.)
    assert asyncio.run(redeployed()) == undisturbed
    deadline = time.monotonic() + 60
    while len(engine_replica_stats(serve_cluster)) != 1:  # the old ones drained away
        assert time.monotonic() < deadline
        time.sleep(1)
