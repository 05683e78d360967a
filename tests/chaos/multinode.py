"""A 3-node Ray cluster on this machine (ray.cluster_utils: a head and two workers, each its
own raylet), our app deployed on it as deploy.yaml would place it (the ingress and Serve's
proxy on the head, one engine replica per worker and the control plane on the workers
through custom resources), and one worker node removed while 16 greedy requests run: the
node of an engine replica (`engine`), or the node of the cluster controller (`control`,
which also holds an engine replica, and maybe the metrics board). With `+tp` (`engine+tp`,
`control+tp`) each engine replica has two tensor-parallel ranks, each in a bundle of the
replica's placement group. With `+tune`, the tuner's trials then run as Ray tasks on two
fresh worker nodes, one of them lost mid-search (tests/chaos/tune_nodes.py).

Run in a process of its own (`python -m tests.chaos.multinode control+tp`): a process
joins one Ray cluster, and the test session's own local Ray is another. Prints one JSON
object.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import psutil

HEAD = {"head": 1}
WORKER = {"engine_node": 1, "control": 1}
# What a user's deploy.yaml says for this layout (docs/cluster.md, "Multi-node").
LAYOUT = {
    "engine_replicas": {"num_replicas": 2, "num_cpus": 0.5, "resources": {"engine_node": 0.5}},
    "ingress_replicas": {"num_replicas": 1, "num_cpus": 0.25, "resources": {"head": 0.01}},
}
CONTROL = {"controller": {"resources": {"control": 0.01}}}
# Two tensor-parallel ranks per engine replica: a placement group of two bundles, STRICT_PACK.
TP = {"engine": {"tensor_parallel_size": 2}}


# Deploys tried until the two engine replicas run on different workers.
DEPLOYS = 3


def _node_of(pid: int, workers: list) -> int | None:
    """Which worker node's raylet started process `pid` (None: the head's, or a node gone)."""
    ancestors = {p.pid for p in psutil.Process(pid).parents()}
    for i, node in enumerate(workers):
        raylets = node.all_processes.get("raylet", [])
        if raylets and raylets[0].process.pid in ancestors:
            return i
    return None


def _worker_running(deployment: str, workers: list) -> int:
    """The worker node running a Serve replica of `deployment` (its process title names it;
    other Ray clusters on this machine, such as the test session's, run their own)."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        if any(deployment in part for part in proc.info["cmdline"] or []):
            node = _node_of(proc.info["pid"], workers)
            if node is not None:
                return node
    raise LookupError(deployment)


def _ranks_with_leader(stats: dict[str, dict], workers: list) -> list[bool]:
    """For each tensor-parallel rank process of these replicas: whether it runs on its
    leader's node (none without tensor parallelism)."""
    same = []
    for s in stats.values():
        pattern = f"engine.runner.rank_process [0-9]+ leader={s['pid']} "
        found = subprocess.run(["pgrep", "-f", pattern], capture_output=True, text=True)
        leader = _node_of(s["pid"], workers)
        same += [_node_of(int(pid), workers) == leader for pid in found.stdout.split()]
    return same


def until_ok(url: str, text: str, timeout: float) -> float | None:
    """Seconds until `url` answers 200 with `text` in its body, or None."""
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        try:
            resp = httpx.get(url, timeout=5)
            if resp.status_code == 200 and text in resp.text:
                return round(time.monotonic() - start, 1)
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return None


def replica_stats(handle, count: int, timeout: float) -> dict[str, dict]:
    """The stats of `count` engine replicas by replica id (fewer if not all answer within
    `timeout`)."""
    seen: dict[str, dict] = {}
    deadline = time.monotonic() + timeout
    while len(seen) < count and time.monotonic() < deadline:
        try:
            stats = handle.stats.remote().result(timeout_s=10)
        except Exception:  # a replica on the dead node, or one still starting
            time.sleep(0.5)
            continue
        seen[stats["replica_id"]] = stats
    return seen


def main(scenario: str) -> dict:
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS", "1")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app import build_app
    from serve_app.deploy.local_cluster import free_port
    from tests.chaos.conftest import chaos_args, differences, run_all, run_with_fault, stage
    from tests.chaos.tune_nodes import tune_across
    from tests.conftest import tiny_model_dir

    store = 128 << 20
    cluster = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 2, "resources": HEAD, "object_store_memory": store},
    )
    workers = [
        cluster.add_node(num_cpus=2, resources=WORKER, object_store_memory=store) for _ in range(2)
    ]
    result: dict = {}
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        parts = scenario.split("+")
        layout = LAYOUT | (CONTROL if "control" in parts else {}) | (TP if "tp" in parts else {})
        base = f"http://127.0.0.1:{port}/mn"
        # Each worker holds two engine replicas (so one can come back on the survivor), and
        # Ray's spreading of them is best effort: where both land on one node, deploy again.
        for deploy in range(1, DEPLOYS + 1):
            stage("cluster up; deploying")
            app = build_app(chaos_args(tiny_model_dir(), **layout))
            serve.run(app, name="mn", route_prefix="/mn")
            stage("app running")
            handle = serve.get_deployment_handle("EngineServer", app_name="mn")
            before = replica_stats(handle, 2, 60)
            placement = sorted(str(_node_of(s["pid"], workers)) for s in before.values())
            if len(set(placement)) == 2 or deploy == DEPLOYS:
                break
            serve.delete("mn")
        result["placement"], result["deploys"] = placement, deploy
        result["ranks_with_leader"] = _ranks_with_leader(before, workers)
        if "control" in parts:
            victim = workers[_worker_running("ClusterController", workers)]
        else:
            victim = workers[int(placement[0])]
        result["victim"] = workers.index(victim)
        started = time.monotonic()
        remove = lambda: cluster.remove_node(victim, allow_graceful=False)  # noqa: E731
        texts = asyncio.run(run_with_fault(f"{base}/v1", remove))
        stage("requests through the node's loss")
        result["seconds_after_kill"] = round(time.monotonic() - started, 1)
        result["completed"] = len(texts)
        expected = asyncio.run(run_all(f"{base}/v1"))
        result["equal"] = texts == expected
        result["differences"] = differences(texts, expected)
        stage("undisturbed run")
        after = replica_stats(handle, 2, 90)  # Serve replaces the lost replica on the survivor
        result["replicas_after"] = len(after)
        survivor = workers.index(next(w for w in workers if w is not victim))
        result["on_survivor"] = sum(_node_of(s["pid"], workers) == survivor for s in after.values())
        result["blocks_free"] = all(s["num_used_blocks"] == 0 for s in after.values())
        result["ranks_with_leader_after"] = _ranks_with_leader(after, workers)
        # Engine metrics come back once the board (restarted elsewhere if it was there) hears
        # from the replicas; the cluster view once the controller is back.
        result["metrics_after_s"] = until_ok(f"{base}/metrics", "dynabatch:num_requests", 90)
        result["cluster_after_s"] = until_ok(f"{base}/v1/cluster", "replicas", 90)
        stage("metrics and cluster view back")
        if "tune" in parts:
            with tempfile.TemporaryDirectory() as out:
                result["tune"] = tune_across(cluster, Path(out))
            stage("tuned across nodes")
    finally:  # no graceful stop: the cluster goes whole, its processes with it
        ray.shutdown()
        cluster.shutdown()
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1] if len(sys.argv) > 1 else "engine")))
