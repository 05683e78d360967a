"""deploy.yaml's app with `small`, on a local cluster as the tests and benchmarks start one
(serve_app.deploy.local_cluster); prints `URL <ingress>/v1` and serves until killed."""

import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO))

from loadtests.serve_bench import deploy_args  # noqa: E402
from serve_app import build_app  # noqa: E402
from serve_app.deploy.local_cluster import ingress_url, run_app, start_local_serve  # noqa: E402

model = {"model": str(REPO / "models" / "small"), "served_model_name": "small"}
args = deploy_args(str(REPO / "deploy.yaml"), model)
port = start_local_serve(log_level="WARNING")
run_app(build_app(args), "llm")
print("URL", ingress_url("llm", port) + "/v1", flush=True)
while True:
    time.sleep(3600)
