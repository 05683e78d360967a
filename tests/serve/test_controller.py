"""The cluster controller and queue-depth autoscaling, for real: local Ray, Serve, HTTP.

App `scaling` (route /scaling): engine replicas that hold 2 requests in a batch until the
controller's SLA policy raises the limit (a latency target far above what the tiny model
takes), and autoscaling between 1 and 2 replicas with short delays.
"""

from __future__ import annotations

import asyncio
import subprocess
import sys
import time
from collections.abc import Callable, Iterator

import httpx
import openai
import pytest

from tests.local_serve import ServeCluster, app_args
from tests.serve.load import Load, wait_for
from tests.serve.test_metrics import scrape, total

pytestmark = pytest.mark.timeout(400)

SCALING = {
    "engine": {"kv_cache_bytes": 8 << 20, "max_num_seqs": 2, "max_model_len": 512},
    "max_queued_requests": 256,
    "batching": {
        "policy": "sla",
        "sla_target_ms": 1000,  # the tiny model is far under it: the limit may only grow
        "sla_eps_ms": 10,
        "batch_size_lower": 1,
        "batch_size_upper": 4,
        "sla_alpha": 1,
        "sla_delta": 2,
        "sla_max_step": 2,
    },
    "controller": {"report_interval_s": 0.25, "stale_after_s": 3.0},
    "autoscaling": {
        "min_replicas": 1,
        "max_replicas": 2,
        "target_waiting": 2,
        "downscale_waiting": 0.5,
        "downscale_utilization": 1.0,
        "upscale_delay_s": 1.0,
        "downscale_delay_s": 3.0,
        "metrics_interval_s": 0.25,
        "look_back_period_s": 1.0,
    },
    "engine_replicas": {"num_cpus": 0.5},
}


@pytest.fixture(scope="module")
def scaling_app(serve_cluster: ServeCluster) -> Iterator[str]:
    from ray import serve

    from serve_app import build_app

    serve.run(
        build_app(app_args(serve_cluster.model, **SCALING)),
        name="scaling",
        route_prefix="/scaling",
    )
    try:
        yield f"{serve_cluster.base_url}/scaling"
    finally:
        serve.delete("scaling")


def cluster_view(base: str) -> dict:
    r = httpx.get(f"{base}/v1/cluster", timeout=10)
    assert r.status_code == 200, r.text
    return r.json()


def engine_replica_states(app: str) -> dict[str, int]:
    from ray import serve

    return dict(serve.status().applications[app].deployments["EngineServer"].replica_states)


def running_engines(app: str) -> int:
    return engine_replica_states(app).get("RUNNING", 0)


def test_controller_hears_every_replica_and_engines_apply_its_limits(serve_cluster, scaling_app):
    # The `llm` app: two engine replicas, both in the controller's view.
    view = wait_for(
        lambda: (v := cluster_view(serve_cluster.base_url))["num_replicas"] == 2 and v,
        30,
        "both llm replicas reporting",
    )
    assert all(r["age_s"] < 3 for r in view["replicas"])
    assert {r["limits"]["max_num_seqs"] for r in view["replicas"]} == {64}  # static
    # The same view as a table, from the command line.
    table = subprocess.run(
        [sys.executable, "-m", "cluster.status", "--url", serve_cluster.base_url],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    ).stdout
    assert "engine replicas reporting" in table
    for r in view["replicas"]:
        assert r["replica_id"][:10] in table

    # The `scaling` app: configured max_num_seqs 2; the SLA policy (in the controller) raises
    # it once it sees decode steps far under target, and the engine then runs more than 2.
    # Waves of 4 until then: one burst of the tiny model may be over within a report period.
    with Load(scaling_app, burst=4, max_tokens=32, waves=True) as waves:
        raised = wait_for(
            lambda: any(
                r["limits"]["max_num_seqs"] > 2 for r in cluster_view(scaling_app)["replicas"]
            ),
            60,
            "the controller raising max_num_seqs above 2",
        )
    assert raised and set(waves.codes) <= {200}
    peak = {"running": 0}
    # 256 tokens: long enough that sampling every 50 ms sees the batch (~3 ms a step here).
    with Load(scaling_app, burst=8, max_tokens=256) as load:
        from ray import serve

        handle = serve.get_deployment_handle("EngineServer", app_name="scaling")
        while not load.done:
            stats = handle.stats.remote().result()
            peak["running"] = max(peak["running"], stats["num_running"])
            assert stats["controlled"] and stats["num_reports_ok"] > 0
            time.sleep(0.05)
    assert load.codes == [200] * 8
    assert peak["running"] > 2, "the engine never ran more than its configured 2"


def test_burst_scales_up_then_back_down_without_failures(scaling_app):
    wait_for(
        lambda: (
            running_engines("scaling") == 1 and engine_replica_states("scaling") == {"RUNNING": 1}
        ),
        60,
        "one replica",
    )
    with Load(scaling_app, trickle=True) as trickle:
        # Waves of 64 until the second replica serves: one wave of the tiny model can end
        # before a new replica has started (8 s here), and Serve then stops it unstarted.
        with Load(scaling_app, burst=64, max_tokens=160, waves=True) as burst:
            t0 = time.monotonic()
            wait_for(lambda: running_engines("scaling") >= 2, 60, "a second engine replica")
            scaled_up_after = time.monotonic() - t0
            # Both replicas report to the controller.
            wait_for(lambda: cluster_view(scaling_app)["num_replicas"] == 2, 20, "2 in the view")
        t1 = time.monotonic()
        wait_for(lambda: engine_replica_states("scaling") == {"RUNNING": 1}, 90, "scale down to 1")
        scaled_down_after = time.monotonic() - t1
        # The removed replica drops out of the controller's view.
        wait_for(lambda: cluster_view(scaling_app)["num_replicas"] == 1, 20, "1 in the view")
    assert len(burst.codes) >= 64 and set(burst.codes) == {200}
    assert trickle.codes and set(trickle.codes) == {200}
    print(f"scaled up {scaled_up_after:.1f} s into the burst, down {scaled_down_after:.1f} s after")


def test_settings_applied_live_change_no_stream_and_restart_nothing(scaling_app):
    """POST /v1/cluster/settings while 16 greedy streams run: static batching at 3, a token
    budget of 256, and at least 2 replicas. The streams end as an undisturbed run's; the
    controller runs the new policy on every replica, the autoscaling rule brings the second
    replica, no replica restarts; a knob that needs a restart is a 400 naming it."""
    import threading

    from cluster.tune.app_client import apply_settings

    url = f"{scaling_app}/v1/cluster/settings"
    wait_for(lambda: running_engines("scaling") == 1, 60, "one replica")
    before = httpx.get(url, timeout=10).json()
    assert before["source"] == "deploy.yaml" and before["version"] == 0, before
    assert before["batching"]["policy"] == "sla" and before["engine"]["max_num_seqs"] == 2
    replicas_before = set(engine_replica_ids("scaling"))
    expected = asyncio.run(greedy_streams(scaling_app))
    fragment = {
        "batching": {"policy": "static"},
        "engine": {"max_num_seqs": 3, "max_num_batched_tokens": 256},
        "autoscaling": {"min_replicas": 2, "target_waiting": 3},
    }
    answers: list[httpx.Response] = []

    def post() -> None:
        answers.append(httpx.post(url, json=fragment, timeout=30))

    poster = threading.Thread(target=post)
    texts = asyncio.run(greedy_streams(scaling_app, poster.start))
    poster.join()
    assert texts == expected
    applied = answers[0].json()
    assert answers[0].status_code == 200 and applied["controller_confirmed"], applied
    assert applied["version"] == 1 and applied["source"] == "applied"
    assert (
        applied["autoscaling"]["min_replicas"] == 2 and applied["autoscaling"]["max_replicas"] == 2
    )
    assert httpx.get(url, timeout=10).json() == {
        k: v for k, v in applied.items() if k != "controller_confirmed"
    }
    view = cluster_view(scaling_app)
    assert view["policy"] == "static" and view["settings_version"] == 1
    wait_for(lambda: running_engines("scaling") == 2, 60, "the second replica min_replicas asks")
    applied_limits = {"max_num_seqs": 3, "max_num_batched_tokens": 256}

    def both_at_applied_limits() -> bool:
        rows = cluster_view(scaling_app)["replicas"]
        return len(rows) == 2 and all(r["limits"] == applied_limits for r in rows)

    wait_for(both_at_applied_limits, 20, "both replicas at the applied limits")
    assert replicas_before <= set(engine_replica_ids("scaling")), "a replica restarted"
    refused = httpx.post(url, json={"engine": {"max_model_len": 1024}}, timeout=10)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["param"] == "engine.max_model_len"
    assert httpx.get(url, timeout=10).json()["version"] == 1
    # Back as deployed, as `cluster.tune --apply` posts tuned.yaml's args (initial_replicas,
    # which means something only at a start, left out).
    back = {k: before[k] for k in ("batching", "engine", "autoscaling")}
    back["autoscaling"] = back["autoscaling"] | {"initial_replicas": 1}
    with pytest.raises(ValueError, match="400 .*engine.max_model_len"):
        apply_settings(scaling_app, {"engine": {"max_model_len": 1024}}, None)
    reverted = apply_settings(scaling_app, back, None)
    assert reverted["version"] == 2 and reverted["batching"] == before["batching"], reverted
    assert cluster_view(scaling_app)["policy"] == "sla"


async def greedy_streams(base: str, midway: Callable[[], None] | None = None) -> list[str]:
    """16 greedy streams of 48 tokens; `midway` called once the first has 8 of them (the
    replicas run 2 or 3 at a time: most have not started)."""
    client = openai.AsyncOpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0)

    async def one(i: int) -> str:
        text: list[str] = []
        stream = await client.completions.create(
            model="tiny",
            prompt=f"Story {i}: once upon a time",
            max_tokens=48,
            temperature=0,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            text.append(chunk.choices[0].text)
            if midway is not None and i == 0 and len(text) == 8:
                midway()
        return "".join(text)

    return list(await asyncio.gather(*(one(i) for i in range(16))))


def engine_replica_ids(app: str) -> list[str]:
    """The Ray actor names of the app's live engine replicas."""
    import ray

    prefix = f"SERVE_REPLICA::{app}#EngineServer#"
    return [a["name"] for a in ray.util.list_named_actors(all_namespaces=True)
            if a["name"].startswith(prefix)]  # fmt: skip


def _controller_name(app: str) -> str | None:
    """The Ray actor name of the app's live controller replica (None while there is none)."""
    import ray

    names = [
        a["name"]
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["name"].startswith(f"SERVE_REPLICA::{app}#ClusterController#")
    ]
    assert len(names) <= 1, names
    return names[0] if names else None


def test_killing_the_controller_fails_no_request_and_control_resumes(serve_cluster):
    import ray
    from ray import serve

    base = serve_cluster.base_url
    name = _controller_name("llm")
    assert name is not None
    handle = serve.get_deployment_handle("EngineServer", app_name="llm")
    # 480 tokens each: the burst must outlast the 0.5 s below (the tiny model decodes 8
    # requests in ~3 ms a step here).
    with Load(base, trickle=True) as trickle, Load(base, burst=16, max_tokens=480) as burst:
        time.sleep(0.5)
        assert not burst.done
        ray.kill(ray.get_actor(name, namespace="serve"), no_restart=True)
        killed_at = time.monotonic()
        # Engine metrics do not ride the controller: both replicas stay in /metrics.
        assert total(scrape(base), "dynabatch:num_engine_replicas") == 2
        # Serve starts a new controller replica; it rebuilds its view from the next reports.
        wait_for(
            lambda: _controller_name("llm") not in (None, name), 60, "a new controller", period=0.5
        )
        view = wait_for(
            lambda: (v := _view_or_none(base)) and v["num_replicas"] == 2 and v,
            60,
            "the new controller to hear both replicas",
        )
        assert view["controller_uptime_s"] <= time.monotonic() - killed_at
        wait_for(lambda: burst.done, 300, "the burst to finish", period=0.5)
    assert burst.codes == [200] * 16
    assert trickle.codes and set(trickle.codes) == {200}
    reports = handle.stats.remote().result()["num_reports_ok"]
    wait_for(
        lambda: handle.stats.remote().result()["num_reports_ok"] > reports, 10, "reports resuming"
    )


def _view_or_none(base: str) -> dict | None:
    r = httpx.get(f"{base}/v1/cluster", timeout=10)
    return r.json() if r.status_code == 200 else None


def test_replica_over_the_sla_target_is_throttled_live(serve_cluster):
    """An SLA target no step can meet: the controller marks the replica throttled, says why,
    and the engine's batch limit comes down from its configured 16 (the engine applies it)."""
    from ray import serve

    from serve_app import build_app

    args = app_args(
        serve_cluster.model,
        engine={"kv_cache_bytes": 8 << 20, "max_num_seqs": 16, "max_model_len": 512},
        batching={"policy": "sla", "sla_target_ms": 0.01, "sla_eps_ms": 0.001},
        controller={"report_interval_s": 0.25},
        engine_replicas={"num_replicas": 1, "num_cpus": 0.25},
    )
    serve.run(build_app(args), name="slow", route_prefix="/slow")
    base = f"{serve_cluster.base_url}/slow"
    try:
        # Waves until then: the throttle holds only while reports carry decode steps.
        with Load(base, burst=12, max_tokens=64, waves=True) as load:
            row = wait_for(
                lambda: next((r for r in cluster_view(base)["replicas"] if r["throttled"]), None),
                60,
                "the replica to be throttled",
            )
        assert "over the 0.01 ms target" in row["reason"]
        assert row["limits"]["max_num_seqs"] < 16
        handle = serve.get_deployment_handle("EngineServer", app_name="slow")
        stats = handle.stats.remote().result()
        assert stats["decision"]["limits"]["max_num_seqs"] < 16
        assert len(load.codes) >= 12 and set(load.codes) == {200}
    finally:
        serve.delete("slow")
