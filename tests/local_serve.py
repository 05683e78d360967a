"""A real local Ray instance with Serve apps built by serve_app.build_app.

`llm` (route /): 2 engine replicas behind 1 ingress, the deploy.yaml shape, with ngram
speculation on, drafting whenever it finds drafts (outputs are unchanged by it, so every
test of this app also proves that).
`narrow` (route /narrow): 1 engine replica that holds 4 requests (2 running + 2 queued), for
overload and disconnect tests where one replica's stats must tell the whole story; it does
not speculate. Its model is a Hub id, `acme/tiny` (the same tiny checkpoint, served by
tests/hub_server.py on loopback: its ingress and engine replica fetch it as from the Hub).
`emulated` (route /emulated, the `emulated_app` fixture: only for the modules that use it):
2 emulated engine replicas (an 8B model on an H100 at the cost model's step times,
docs/emulated-replica.md) behind 1 ingress: the serving path at a GPU's token rate, with
ngram speculation drafting whenever it finds drafts.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent


def deploy_yaml() -> dict[str, Any]:
    with open(REPO / "deploy.yaml") as f:
        return yaml.safe_load(f)


def deploy_yaml_args() -> dict[str, Any]:
    return deploy_yaml()["applications"][0]["args"]


def app_args(model: str, **overrides: Any) -> dict[str, Any]:
    """deploy.yaml's args, resized for tests (smaller cache and context, two engine replicas),
    with LoRA adapters (tests/lora_adapters.py)."""
    from serve_app.config import merged
    from tests.lora_adapters import lora_adapters

    adapters = lora_adapters(model)
    test_sizes = {
        "model": model,
        "engine": {
            "kv_cache_bytes": 32 << 20,
            "max_num_seqs": 64,
            "max_model_len": 512,
            # Drafting whenever prompt lookup finds drafts (not only where the adaptive rule
            # finds it pays): every test of this app goes through verification more.
            "speculative": {"enabled": True, "adaptive": False},
            # sql from the start; chat and code from the search path at their first request.
            "lora": {
                "enabled": True,
                "adapters": {"sql": adapters["sql"]},
                "search_path": str(Path(adapters["sql"]).parent),
                "max_loras": 2,
            },
        },
        "engine_replicas": {"num_replicas": 2, "num_cpus": 0.5},
        "ingress_replicas": {"num_replicas": 1, "num_cpus": 0.25},
        "autoscaling": None,  # a fixed count; tests/serve/test_controller.py scales its own app
    }
    return merged(merged(deploy_yaml_args(), test_sizes), overrides)


NARROW_AUTH = {"Authorization": "Bearer narrow-key"}
NARROW = {
    "engine": {
        "kv_cache_bytes": 8 << 20,
        "max_num_seqs": 2,
        "max_model_len": 512,
        "speculative": {"enabled": False},
    },
    # The strict settings: unknown request fields are a 400 here (ignored in `llm`), and
    # /v1/* asks for an API key.
    "api": {"unknown_fields": "reject", "api_keys": ["narrow-key"]},
    "max_queued_requests": 2,
    "retry_after_s": 2,
    "engine_replicas": {"num_replicas": 1, "num_cpus": 0.5},
}


EMULATED = {
    "engine": {
        "device": "emulated",
        "emulate": {"model": "Llama-3.1-8B", "gpu": "H100-80GB"},
        "max_num_seqs": 256,
        "max_model_len": 2048,
        "lora": {"enabled": False, "adapters": {}, "search_path": None},
    },
    "max_queued_requests": 256,
    # No CPU of the session's 4 (the other apps and the controller tests' own take them all).
    "engine_replicas": {"num_replicas": 2, "num_cpus": 0},
    "ingress_replicas": {"num_replicas": 1, "num_cpus": 0},
}


HUB_MODEL = "acme/tiny"  # the `narrow` app's model


@dataclass
class ServeCluster:
    base_url: str  # http://127.0.0.1:PORT
    model: str
    args: dict[str, Any]
    hub: Any = None  # tests/hub_server.py's HubServer, which serves the `narrow` app's model

    def v1(self, app: str = "") -> str:
        return f"{self.base_url}{'/' + app if app else ''}/v1"

    def engine_handle(self, app: str, model: str | None = None):
        """The engine deployment of an app (`model`: of that model, where it serves several)."""
        from ray import serve

        from serve_app.deploy.builder import deployment_name

        return serve.get_deployment_handle(deployment_name("EngineServer", model), app_name=app)

    def replica_stats(self, app: str, num_replicas: int, timeout: float = 20.0) -> dict[str, dict]:
        """Stats of every engine replica of an app, keyed by replica id (polls until all seen)."""
        handle = self.engine_handle(app)
        seen: dict[str, dict] = {}
        deadline = time.monotonic() + timeout
        while len(seen) < num_replicas:
            if time.monotonic() > deadline:
                raise TimeoutError(f"saw {len(seen)} of {num_replicas} replicas")
            stats = handle.stats.remote().result()
            seen[stats["replica_id"]] = stats
        return seen


def metric_total(app_url: str, *samples: str) -> float:
    """The sum of an app's /metrics samples whose lines start with one of `samples` (a
    metric's name with its labels and the space before the value); 0 where none is there."""
    import httpx

    metrics = httpx.get(f"{app_url}/metrics", timeout=10).text
    return sum(float(x.rsplit(" ", 1)[1]) for x in metrics.splitlines() if x.startswith(samples))


@pytest.fixture(scope="session")
def serve_cluster() -> Iterator[ServeCluster]:
    from ray import serve
    from ray.serve.api import RunTarget

    from serve_app import build_app
    from serve_app.deploy.local_cluster import start_local_serve, stop_local_serve
    from tests.conftest import tiny_model_dir  # tests/conftest.py imports this module
    from tests.hub_server import HubRepo, HubServer

    model = tiny_model_dir("llama")
    hub = HubServer({HUB_MODEL: HubRepo({"main": Path(model)})}).start()
    # Ray's processes start with this environment: the replicas download from `hub`.
    os.environ["HF_ENDPOINT"] = hub.endpoint
    os.environ["HF_HUB_CACHE"] = tempfile.mkdtemp(prefix="hf-hub-cache-")
    try:
        port = start_local_serve()
        args = app_args(model)
        narrow = build_app({**app_args(model, **NARROW), "model": HUB_MODEL})
        serve.run_many(  # the apps start together
            [
                RunTarget(target=build_app(args), name="llm", route_prefix="/"),
                RunTarget(target=narrow, name="narrow", route_prefix="/narrow"),
            ]
        )
        _wait_ready(f"http://127.0.0.1:{port}")
        yield ServeCluster(f"http://127.0.0.1:{port}", model, args, hub)
    finally:
        stop_local_serve()
        hub.stop()


@pytest.fixture(scope="module")
def emulated_app(serve_cluster: ServeCluster) -> Iterator[ServeCluster]:
    """The `emulated` app on the session's Serve, for one test module: its replicas report to
    their controller and take host CPU while they live, so they live only while needed."""
    from ray import serve

    from serve_app import build_app

    serve.run(
        build_app(app_args(serve_cluster.model, **EMULATED)),
        name="emulated",
        route_prefix="/emulated",
    )
    yield serve_cluster
    serve.delete("emulated")


def _wait_ready(base_url: str, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            urls = [f"{base_url}{app}/health" for app in ("", "/narrow")]
            if all(httpx.get(url, timeout=5).status_code == 200 for url in urls):
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise TimeoutError("Serve apps did not become ready")


def assert_serves_and_frees(cluster: ServeCluster, timeout: float = 30.0) -> None:
    """The `llm` app answers a request, then both engine replicas hold no request and no block
    (after a test that threw everything at it)."""
    import httpx

    resp = httpx.post(
        f"{cluster.v1()}/completions",
        json={"model": "tiny", "prompt": "after", "max_tokens": 4},
        timeout=60,
    )
    assert resp.status_code == 200, resp.text
    deadline = time.monotonic() + timeout
    while True:
        stats = cluster.replica_stats("llm", 2)
        if all(s["num_used_blocks"] == 0 and s["num_streams"] == 0 for s in stats.values()):
            return
        assert time.monotonic() < deadline, stats
        time.sleep(0.2)
