"""A worker node whose Python lacks our package, serving our app through Ray's runtime_env.

The head is a raylet of this (test) environment; the worker node is `ray start --block` run
by a venv that sees the same third-party packages but not ours (its site-packages points at
the test venv's by a path file, which Python does not scan for the editable install's hook).
The app goes on as a user deploys it: deploy.yaml with `runtime_env.working_dir` naming the
zip of serve_app.deploy.code_bundle (a file:// URI here, s3:// or https:// on a cluster), submitted
by the `serve run` command line; its engine and ingress replicas are placed on the worker
node by custom resources.

Run as a script from a folder outside the repository (a driver's own sys.path reaches Ray's
workers): `python tests/chaos/bare_node.py MODEL_DIR WORK_DIR`. Prints one JSON object.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import sysconfig
import time
from pathlib import Path

import httpx
import psutil
import yaml

REPO = Path(__file__).resolve().parents[2]


def bare_python(folder: Path) -> Path:
    """A venv with this one's third-party packages and without ours."""
    base = getattr(sys, "_base_executable", sys.executable)
    subprocess.run([base, "-m", "venv", "--without-pip", str(folder)], check=True)
    site = Path(sysconfig.get_path("purelib", vars={"base": str(folder)}))
    (site / "shared_deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    return folder / "bin" / "python"


def imports_ours(python: Path) -> bool:
    probe = "import importlib.util, sys; sys.exit(importlib.util.find_spec('serve_app') is None)"
    return subprocess.run([str(python), "-c", probe], cwd="/").returncode == 0


def config(zip_uri: str, model: str, port: int) -> dict:
    with open(REPO / "deploy.yaml") as f:
        deploy = yaml.safe_load(f)
    app = deploy["applications"][0]
    app["args"] |= {
        "model": model,
        "engine_replicas": {"num_replicas": 1, "num_cpus": 0.5, "resources": {"bare": 0.5}},
        "ingress_replicas": {"num_replicas": 1, "num_cpus": 0.25, "resources": {"bare": 0.1}},
    }
    app["runtime_env"] = {"working_dir": zip_uri}
    deploy |= {"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": port}}
    return deploy


def _answer(base: str, timeout: float = 240.0) -> dict | None:
    body = {"model": "tiny", "prompt": "Hello, my name is", "max_tokens": 8, "temperature": 0}
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            resp = httpx.post(f"{base}/v1/completions", json=body, timeout=30)
            if resp.status_code == 200:
                return resp.json()
        except httpx.HTTPError:
            pass
        time.sleep(1.0)
    return None


def _on_node(deployment: str, node_root: int) -> bool:
    """Whether a process titled as a replica of `deployment` descends from `node_root`."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        titled = any(deployment in part for part in proc.info["cmdline"] or [])
        if titled and node_root in {p.pid for p in psutil.Process(proc.info["pid"]).parents()}:
            return True
    return False


def main(model: str, work: Path) -> dict:
    import ray
    from ray.cluster_utils import Cluster

    from serve_app.deploy.code_bundle import write_bundle
    from serve_app.deploy.local_cluster import free_port

    python = bare_python(work / "bare")
    result: dict = {"bare_imports_ours": imports_ours(python)}
    zip_path = write_bundle(work / "dynabatch.zip")
    store = str(128 << 20)
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2, "resources": {}})
    start = [str(python), "-c", "from ray.scripts.scripts import main; main()", "start"]
    start += ["--address", cluster.address, "--num-cpus", "2", "--resources", '{"bare": 1}']
    start += ["--object-store-memory", store, "--block", "--disable-usage-stats"]
    node = subprocess.Popen(start, cwd="/", start_new_session=True)
    try:
        ray.init(address=cluster.address, log_to_driver=False)
        deadline = time.monotonic() + 60
        while not any(n["Resources"].get("bare") for n in ray.nodes() if n["Alive"]):
            assert time.monotonic() < deadline, "the bare node never joined"
            time.sleep(0.5)

        # Without a runtime_env the bare node cannot import the app.
        @ray.remote(resources={"bare": 0.01}, num_cpus=0)
        def finds_ours() -> bool:
            import importlib.util

            return importlib.util.find_spec("serve_app") is not None

        result["bare_worker_imports_ours"] = ray.get(finds_ours.remote())
        port = free_port()
        config_path = work / "deploy.yaml"
        config_path.write_text(yaml.safe_dump(config(zip_path.as_uri(), model, port)))
        serve_cli = Path(sys.executable).with_name("serve")
        submit = [str(serve_cli), "run", "--non-blocking", "--address", cluster.address]
        run = subprocess.run([*submit, str(config_path)], cwd=work, capture_output=True, text=True)
        result["serve_run_rc"] = run.returncode
        answer = _answer(f"http://127.0.0.1:{port}")
        result["answered"] = answer is not None
        result["tokens"] = answer["usage"]["completion_tokens"] if answer else 0
        result["engine_on_bare"] = _on_node("EngineServer", node.pid)
        result["ingress_on_bare"] = _on_node("OpenAIIngress", node.pid)
    finally:
        from ray import serve

        try:
            serve.shutdown()
        finally:
            ray.shutdown()
            os.killpg(node.pid, signal.SIGTERM)
            try:
                node.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(node.pid, signal.SIGKILL)
            cluster.shutdown()
    return result


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], Path(sys.argv[2]))))
