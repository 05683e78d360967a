"""A worker node cut off from the network (not killed) while 16 greedy requests run.

The head (ingress, Serve's proxy) and worker A are raylets of this process (ray.cluster_utils)
at 10.231.N.1; worker B is `ray start --block` inside a network namespace of its own at
10.231.N.2, joined to the root namespace by a veth pair. One engine replica runs on each worker
(deployed again where Ray put both on one); once B's replica streams its share of the requests,
early in them, B's link goes down (its processes live on, unreachable; requests not yet sent
may go to B after). If Serve's router sent B none, or the cut missed that window, they run
again (up to 3 times). Serve's health checks find B's replica unresponsive and it is stopped;
the requests it held resume at A's replica. Ray's own node health checks declare B dead later:
in about 10 s here (NODE_HEALTH); at their defaults (about 65 s) a replacement replica Serve
places on B, which Ray still lists, waits that long.
Needs root (ip netns).

Run as `python -m tests.chaos.netns_node`; prints one JSON object.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import subprocess
import sys
import time

from tests.chaos.multinode import DEPLOYS, LAYOUT, WORKER, replica_stats, until_ok

# The GCS's checks of each node (Ray's defaults: every 3 s, 10 s to answer, 5 misses).
NODE_HEALTH = {
    "health_check_period_ms": 1000,
    "health_check_timeout_ms": 1000,
    "health_check_failure_threshold": 5,
}
# The deltas B's replica has streamed through its channels before its link is cut.
STREAMED = 16


def _ip(*args: str, netns: str | None = None) -> None:
    prefix = ["ip", "netns", "exec", netns] if netns else []
    subprocess.run([*prefix, "ip", *args], check=True)


def make_netns(tag: int) -> tuple[str, str, str, str]:
    """A namespace with one veth end (named after this process: `tag`, its pid), after
    removing those of runs that ended without cleaning up (killed at a timeout); returns
    (netns, host-side link, host IP, netns IP)."""
    remove_stale()
    netns, host_link, ns_link = f"dbns{tag}", f"dbh{tag}", f"dbn{tag}"
    subnet = f"10.231.{tag % 250}"
    _ip("netns", "add", netns)
    _ip("link", "add", host_link, "type", "veth", "peer", "name", ns_link)
    _ip("link", "set", ns_link, "netns", netns)
    _ip("addr", "add", f"{subnet}.1/30", "dev", host_link)
    _ip("link", "set", host_link, "up")
    _ip("addr", "add", f"{subnet}.2/30", "dev", ns_link, netns=netns)
    _ip("link", "set", ns_link, "up", netns=netns)
    _ip("link", "set", "lo", "up", netns=netns)
    return netns, host_link, f"{subnet}.1", f"{subnet}.2"


def remove_netns(netns: str, host_link: str) -> None:
    """The namespace, its processes (a node cut off has nothing to drain) and its link."""
    pids = subprocess.run(["ip", "netns", "pids", netns], capture_output=True, text=True)
    for pid in pids.stdout.split():
        with contextlib.suppress(ProcessLookupError):
            os.kill(int(pid), signal.SIGKILL)
    subprocess.run(["ip", "link", "del", host_link], capture_output=True)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def remove_stale() -> None:
    import psutil

    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for name in (line.split()[0] for line in listed.splitlines() if line.strip()):
        tag = name.removeprefix("dbns")
        if name.startswith("dbns") and tag.isdigit() and not psutil.pid_exists(int(tag)):
            remove_netns(name, f"dbh{tag}")


def _pids_under(root: int) -> set[int]:
    import psutil

    try:
        return {p.pid for p in psutil.Process(root).children(recursive=True)}
    except psutil.NoSuchProcess:
        return set()


def _actors_on(node_ip: str) -> list[str]:
    import ray
    from ray.util.state import list_actors

    node = next(n["NodeID"] for n in ray.nodes() if n["NodeManagerAddress"] == node_ip)
    return sorted(actor["class_name"] for actor in list_actors(filters=[("node_id", "=", node)]))


def main() -> dict:
    os.environ.setdefault("RAY_worker_niceness", "0")
    os.environ.setdefault("RAY_SERVE_FORCE_STOP_UNHEALTHY_REPLICAS", "1")
    import ray
    from ray import serve
    from ray.cluster_utils import Cluster

    from serve_app import build_app
    from serve_app.deploy.local_cluster import free_port
    from tests.chaos.conftest import (
        MAX_TOKENS,
        chaos_args,
        differences,
        run_all,
        sequences_resumed,
        stage,
    )
    from tests.conftest import tiny_model_dir

    netns, host_link, host_ip, ns_ip = make_netns(os.getpid())
    result: dict = {}
    store = 128 << 20
    cluster = node_b = None
    try:
        head = {"num_cpus": 2, "resources": {"head": 1}, "object_store_memory": store}
        head["_system_config"] = NODE_HEALTH
        cluster = Cluster(initialize_head=True, head_node_args=head | {"node_ip_address": host_ip})
        cluster.add_node(
            num_cpus=2, resources=WORKER, object_store_memory=store, node_ip_address=host_ip
        )
        start = [sys.executable, "-c", "from ray.scripts.scripts import main; main()", "start"]
        start += ["--address", cluster.address, "--node-ip-address", ns_ip, "--num-cpus", "2"]
        start += ["--resources", json.dumps(WORKER), "--object-store-memory", str(store)]
        start += ["--block", "--disable-usage-stats"]
        node_b = subprocess.Popen(
            ["ip", "netns", "exec", netns, *start], start_new_session=True, cwd="/"
        )
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 90
        while sum(n["Alive"] for n in ray.nodes()) < 3:
            assert time.monotonic() < deadline, "the namespaced node never joined"
            time.sleep(0.5)
        port = free_port()
        serve.start(proxy_location="HeadOnly", http_options={"host": "127.0.0.1", "port": port})
        base = f"http://127.0.0.1:{port}/ns"
        # Ray spreads the two engine replicas over the workers as best it can: where both land
        # on one, deploy again.
        for deploy in range(1, DEPLOYS + 1):
            app = build_app(chaos_args(tiny_model_dir(), **LAYOUT))
            serve.run(app, name="ns", route_prefix="/ns")
            handle = serve.get_deployment_handle("EngineServer", app_name="ns")
            stage("app ready")
            before = replica_stats(handle, 2, 60)
            on_b = {rid for rid, s in before.items() if s["pid"] in _pids_under(node_b.pid)}
            if len(on_b) == 1 or deploy == DEPLOYS:
                break
            stage("both engine replicas on one worker: deploying again")
            serve.delete("ns")
        result["on_b"] = _actors_on(ns_ip)  # for a failure's message
        result["one_replica_per_worker"] = len(before) == 2 and len(on_b) == 1
        if not result["one_replica_per_worker"]:
            return result
        cut_at: list[float] = []

        def b_stats() -> dict | None:
            (rid,) = on_b
            stats = handle.stats.remote(replica_id=rid).result(timeout_s=10)
            return stats if stats["replica_id"] == rid else None

        def early_in_b_streams(since: int) -> bool:
            """B's replica decodes requests it has streamed at least STREAMED deltas of this
            run (`since`: its count before): each has its first delta at the ingress (a
            request cut off before that is sent again from its prompt, not resumed). And
            not past half of MAX_TOKENS a request (one near its end may finish before the
            cut)."""
            stats = b_stats()
            if stats is None or stats["num_decoding"] == 0:
                return False
            streamed = stats["channel_deltas_total"] - since
            if STREAMED <= streamed <= stats["num_decoding"] * MAX_TOKENS // 2:
                keys = ("num_decoding", "channel_deltas_total")
                result["b_at_cut"] = {key: stats[key] for key in keys} | {"since": since}
                return True
            return False

        async def run_and_cut() -> list[str]:
            """The requests, and B's link cut once B's replica streams some of them (not
            once every stream started: B may finish its share before A's streams start)."""
            for _ in range(20):  # a call may land at A's replica
                if (before_run := await asyncio.to_thread(b_stats)) is not None:
                    break
            since = before_run["channel_deltas_total"] if before_run else 0
            run = asyncio.create_task(run_all(f"{base}/v1"))
            while not run.done():
                if await asyncio.to_thread(early_in_b_streams, since):
                    _ip("link", "set", host_link, "down")
                    cut_at.append(time.monotonic())
                    stage("link cut")
                    break
                await asyncio.sleep(0.05)
            return await run

        for _ in range(3):  # Serve's router may send them all to A
            texts = asyncio.run(run_and_cut())
            if cut_at:
                break
            stage("B's replica streamed none of them early enough: running them again")
        result["cut"] = bool(cut_at)
        result["seconds_after_cut"] = round(time.monotonic() - cut_at[0], 1) if cut_at else None
        stage("requests done")
        result["completed"] = len(texts)
        result["resumed"] = sequences_resumed(base)
        result["node_b_dead"] = not any(
            n["Alive"] for n in ray.nodes() if n["NodeManagerAddress"] == ns_ip
        )
        expected = asyncio.run(run_all(f"{base}/v1"))
        stage("undisturbed run done")
        result["equal"] = texts == expected
        result["differences"] = differences(texts, expected)
        after = replica_stats(handle, 2, 90)
        result["replicas_after"] = len(after)
        stage("replicas back")
        result["blocks_free"] = all(s["num_used_blocks"] == 0 for s in after.values())
        result["cluster_after_s"] = until_ok(f"{base}/v1/cluster", "replicas", 90)
    except BaseException:  # what the replicas hold, for the failure's message
        keys = ("num_running", "num_waiting", "num_used_blocks", "num_streams", "num_channels")
        with contextlib.suppress(Exception):
            for rid, got in replica_stats(handle, 2, 15).items():
                held = {k: got.get(k) for k in keys}
                stage(f"replica {rid}: {held}")
        raise
    finally:
        stage("shutting down")  # no graceful stop: the cluster goes whole
        try:
            ray.shutdown()
            stage("ray down")
        finally:
            remove_netns(netns, host_link)  # node B's processes too
            if node_b is not None:
                node_b.wait()
            stage("netns down")
            if cluster is not None:
                cluster.shutdown()
        stage("shut down")
    return result


if __name__ == "__main__":
    print(json.dumps(main()))
