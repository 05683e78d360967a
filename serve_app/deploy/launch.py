"""`make serve`: run `serve run CONFIG`, wait until it answers, print ready-to-paste examples.

python -m serve_app.deploy.launch deploy.yaml [--dashboard]

`serve run` goes on a local Ray cluster of its own (or the one `RAY_ADDRESS` names), started
without Ray's dashboard unless `--dashboard` asks for it: its processes take about a tenth of
an idle app's CPU, which on a CPU host the engine's steps lose, and about 1 GB
(docs/serving.md, "CPU hosts").
Ctrl-C (or SIGTERM) stops `serve run` and the local Ray cluster it started.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import urllib.request

import yaml

from serve_app.config import AppArgs
from serve_app.deploy.local_cluster import LOCAL_CLUSTER_ENV, WITHOUT_DASHBOARD_ENV


def _examples(base: str, models: list[str], proxy: str) -> str:
    """The examples name the first model; the line above them every one."""
    model, served = models[0], ", ".join(f"`{name}`" for name in models)
    return f"""
dynabatch is serving {served} at {base}/v1
(the ingress replica's own port; Serve's HTTP proxy serves the same at {proxy}/v1)

  curl {base}/v1/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "prompt": "Hello, my name is", "max_tokens": 32}}'

  curl -N {base}/v1/chat/completions -H 'Content-Type: application/json' \\
    -d '{{"model": "{model}", "messages": [{{"role": "user", "content": "Hi!"}}], "stream": true}}'

  python -c "
from openai import OpenAI
client = OpenAI(base_url='{base}/v1', api_key='unused')
out = client.chat.completions.create(model='{model}', max_tokens=32,
    messages=[{{'role': 'user', 'content': 'Hi!'}}])
print(out.choices[0].message.content)"

  metrics: {base}/metrics    health: {base}/health    Ctrl-C stops the server.
"""


def _answers(base: str) -> bool:
    try:
        with urllib.request.urlopen(f"{base}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _serve_run(config: str, dashboard: bool) -> None:
    """`serve run CONFIG` in this process, on a Ray cluster started here first (`serve run`
    starts one with the dashboard and has no switch for it)."""
    import ray
    from ray.serve.scripts import cli

    address = os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, namespace="serve")
    else:  # never another cluster left on this machine: a new one
        ray.init(address="local", namespace="serve", include_dashboard=dashboard)
    cli.main(["run", config], prog_name="serve")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("config", nargs="?", default="deploy.yaml")
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds to wait for ready")
    parser.add_argument("--dashboard", action="store_true", help="start Ray's dashboard too")
    parser.add_argument("--serve-run", action="store_true", help=argparse.SUPPRESS)  # the child
    opts = parser.parse_args()
    if opts.serve_run:
        _serve_run(opts.config, opts.dashboard)
        return 0
    with open(opts.config) as f:
        config = yaml.safe_load(f)
    app = config["applications"][0]
    try:  # fail fast, naming a bad field or a model that cannot be fetched
        args = AppArgs.model_validate(app.get("args", {}))
        args.check_sources()
    except ValueError as exc:
        print(f"{opts.config}: {exc}", file=sys.stderr)
        return 2
    http = config.get("http_options", {})
    host = http.get("host", "127.0.0.1")
    host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
    prefix = (app.get("route_prefix") or "/").rstrip("/")
    port = http.get("port", 8000)
    proxy = f"http://{host}:{port}{prefix}"

    env = LOCAL_CLUSTER_ENV | ({} if opts.dashboard else WITHOUT_DASHBOARD_ENV) | dict(os.environ)
    env.setdefault("RAY_DEFAULT_OBJECT_STORE_MAX_MEMORY_BYTES", str(512 << 20))
    # Serve's direct ingress serves HTTP on the ports after the proxy's (docs/serving.md).
    env.setdefault("RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT", str(port + 1))
    first_direct = int(env["RAY_SERVE_DIRECT_INGRESS_MIN_HTTP_PORT"])
    # Serve's own bound (31000) would leave no port to a proxy port above it.
    env.setdefault("RAY_SERVE_DIRECT_INGRESS_MAX_HTTP_PORT", str(first_direct + 999))
    direct = [f"http://{host}:{p}{prefix}" for p in range(first_direct, first_direct + 8)]
    command = [sys.executable, "-m", "serve_app.deploy.launch", opts.config, "--serve-run"]
    child = subprocess.Popen(command + ["--dashboard"] * opts.dashboard, env=env)

    def stop(*_: object) -> None:
        if child.poll() is None:
            child.terminate()  # `serve run` ends its local cluster on SIGTERM

    signal.signal(signal.SIGTERM, stop)
    try:
        deadline = time.monotonic() + opts.timeout
        while child.poll() is None and time.monotonic() < deadline:
            if _answers(proxy):
                base = next((url for url in direct if _answers(url)), proxy)
                names = [one.model_name for one in args.per_model()]
                print(_examples(base, names, proxy), flush=True)
                break
            time.sleep(1.0)
        return child.wait()
    except KeyboardInterrupt:
        stop()
        return child.wait()


if __name__ == "__main__":
    sys.exit(main())
