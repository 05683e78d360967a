"""The chaos suite's own app (`chaos`, 2 engine replicas, 1 ingress, fast health checks) on
the session's local Serve, so the replicas it kills and stops serve nobody else's tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.local_serve import ServeCluster, app_args

APP = "chaos"


@pytest.fixture(scope="session")
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


def engine_replica_stats(serve_cluster: ServeCluster, timeout: float = 60.0) -> dict[str, dict]:
    """Stats of every live engine replica of the chaos app, each asked by its id (Serve's
    router sends a call to the least loaded replica, so polling could miss a busy one)."""
    import ray

    handle = serve_cluster.engine_handle(APP)
    deadline = time.monotonic() + timeout
    while True:
        names = ray.util.list_named_actors(all_namespaces=True)  # the live ones
        prefix = f"SERVE_REPLICA::{APP}#EngineServer#"
        ids = [n["name"][len(prefix) :] for n in names if n["name"].startswith(prefix)]
        seen = {}
        for rid in ids:
            try:
                stats = handle.stats.remote(replica_id=rid).result(timeout_s=5)
            except Exception:  # dying, or not yet serving
                continue
            if stats["replica_id"] == rid:
                seen[rid] = stats
        if ids and len(seen) == len(ids):
            return seen
        assert time.monotonic() < deadline, (ids, list(seen))
        time.sleep(0.5)
